//! Hugging Face BERT folders in: `config.json` (`BertConfig`) and
//! `model.safetensors` of a `BertModel` (names without `bert.`),
//! `BertForMaskedLM`, `BertForPreTraining` or
//! `BertForSequenceClassification`. `nn.Linear`
//! weights (out, in) are transposed to the layout's (in, out); query, key
//! and value are joined into `qkv`.

use super::config::{BertConfig, BertHead};
use super::layout::{classifier_names, layout, EMBEDDINGS, HEAD_MLM};
use crate::data::wordpiece::WordPiece;
use crate::error::{Error, Result};
use crate::model::files::{check_fits, check_holds, no_place, read_hf_config};
use crate::model::layout::TensorSpec;
use crate::store::{
    checksum, read_safetensors, widen_into, write_atomic, write_json, write_safetensors, Data,
};
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// The config of a Hugging Face BERT folder; `head` replaces the one its
/// architecture implies (a `BertModel` implies none, so it must be given).
pub fn read_config(dir: &Path, head: Option<BertHead>) -> Result<BertConfig> {
    let (path, j) = read_hf_config(dir)?;
    let bad = |what: &str| Error::Input(format!("{}: {what}", path.display()));
    if j["model_type"].as_str() != Some("bert") {
        return Err(bad("model_type is not \"bert\""));
    }
    let get = |k: &str| {
        j[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| bad(&format!("{k} is missing or not a whole number")))
    };
    // an optional setting: absent or null, or of its type
    let optional = |k: &str, kind: &str| optional(&j, k, kind).map_err(|e| bad(&e));
    match optional("hidden_act", "a string")?.and_then(|v| v.as_str()) {
        Some("gelu") | None => {}
        Some(other) => {
            return Err(bad(&format!(
                "hidden_act {other} is not supported (gelu only)"
            )))
        }
    }
    if optional("position_embedding_type", "a string")?.is_some_and(|p| p != "absolute") {
        return Err(bad("only absolute position embeddings are supported"));
    }
    let layer_norm_eps = optional("layer_norm_eps", "a number")?.and_then(|v| v.as_f64());
    let arch = j["architectures"][0].as_str().unwrap_or("BertModel");
    let implied = match arch {
        "BertForMaskedLM" => Some(BertHead::Mlm),
        "BertForPreTraining" => Some(BertHead::Pretrain),
        "BertForSequenceClassification" => {
            let labels = j["id2label"]
                .as_object()
                .map(|m| m.len())
                .or_else(|| j["num_labels"].as_u64().map(|n| n as usize))
                .unwrap_or(2);
            Some(BertHead::Classify { labels })
        }
        _ => None,
    };
    let head = head.or(implied).ok_or_else(|| {
        bad(&format!(
            "a {arch} has no head (a masked LM's or a classifier's): fine-tune a classifier from it with `train --task classify --init-from DIR --data SET`, or pretrain it further with `train --task mlm --init-from DIR --data TEXT`; `eval` and `export` read a folder with its head (BertForMaskedLM, BertForPreTraining or BertForSequenceClassification)"
        ))
    })?;
    let cfg = BertConfig {
        n_layer: get("num_hidden_layers")?,
        n_head: get("num_attention_heads")?,
        n_embd: get("hidden_size")?,
        n_inner: get("intermediate_size")?,
        block_size: get("max_position_embeddings")?,
        type_vocab: get("type_vocab_size")?,
        vocab_size: get("vocab_size")?,
        layer_norm_eps: layer_norm_eps.unwrap_or(1e-12) as f32,
        head,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// `j`'s optional setting `k`: absent or null, or `kind` ("a string" or
/// "a number"), or why not.
fn optional<'a>(
    j: &'a serde_json::Value,
    k: &str,
    kind: &str,
) -> std::result::Result<Option<&'a serde_json::Value>, String> {
    let is_kind = |v: &serde_json::Value| match kind {
        "a string" => v.is_string(),
        _ => v.is_number(),
    };
    match &j[k] {
        serde_json::Value::Null => Ok(None),
        v if is_kind(v) => Ok(Some(v)),
        v => Err(format!("{k} is {v}, not {kind}")),
    }
}

/// A classifier folder's label names in id order (its `id2label`), none
/// where it has no such map or only `transformers`' defaults (`LABEL_0`,
/// `LABEL_1`, ...), which name nothing.
pub fn label_names(dir: &Path) -> Result<Vec<String>> {
    let (path, j) = read_hf_config(dir)?;
    let Some(map) = j["id2label"].as_object() else {
        return Ok(Vec::new());
    };
    let bad = || {
        Error::Input(format!(
            "{}: id2label is not a map of the ids 0..{} to names",
            path.display(),
            map.len()
        ))
    };
    let names = (0..map.len())
        .map(|i| {
            map.get(&i.to_string())
                .and_then(|v| v.as_str())
                .map(str::to_string)
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(bad)?;
    let default = names
        .iter()
        .enumerate()
        .all(|(i, n)| *n == format!("LABEL_{i}"));
    Ok(if default { Vec::new() } else { names })
}

/// A LayerNorm's names now and in Google's TensorFlow checkpoints, which
/// [`find`] reads and [`canonical`] reads back.
const LEGACY_NAMES: [(&str, &str); 2] = [
    ("LayerNorm.weight", "LayerNorm.gamma"),
    ("LayerNorm.bias", "LayerNorm.beta"),
];

/// A tensor of the file as f32 with its shape, under `name` or, for a
/// `BertModel`'s file, `name` without its `bert.` prefix; a LayerNorm's
/// weight and bias also under the names of Google's TensorFlow checkpoints
/// (`LayerNorm.gamma`, `LayerNorm.beta`), which the hub's
/// `bert-base-uncased` keeps and `transformers` renames as it loads.
fn find(st: &SafeTensors, name: &str) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
    let legacy = LEGACY_NAMES
        .iter()
        .find_map(|(now, then)| name.strip_suffix(now).map(|at| format!("{at}{then}")));
    let names = [Some(name.to_string()), legacy];
    let short = |n: &String| n.strip_prefix("bert.").map(str::to_string);
    let mut candidates = names
        .iter()
        .flatten()
        .flat_map(|n| [Some(n.clone()), short(n)]);
    let Some(view) = candidates.find_map(|n| n.and_then(|n| st.tensor(&n).ok())) else {
        return Ok(None);
    };
    let mut data = vec![0.0; view.shape().iter().product()];
    if !widen_into(view.dtype(), view.data(), &mut data) {
        return Err(Error::Input(format!(
            "tensor {name} is {:?}; F32, BF16 or F16 checkpoints only",
            view.dtype()
        )));
    }
    Ok(Some((view.shape().to_vec(), data)))
}

fn need(st: &SafeTensors, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    match find(st, name)? {
        Some((s, data)) if s == shape => Ok(data),
        Some((s, _)) => Err(Error::Input(format!(
            "tensor {name} has shape {s:?}, the config wants {shape:?}"
        ))),
        None => Err(Error::Input(format!("the checkpoint has no tensor {name}"))),
    }
}

/// (out, in) row-major -> (in, out).
fn transpose(w: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let mut t = vec![0.0; w.len()];
    for o in 0..out {
        for i in 0..inp {
            t[i * out + o] = w[o * inp + i];
        }
    }
    t
}

/// Where a Hugging Face tensor sits in one of the layout's: under `hf`,
/// of `shape` (the padded vocabulary's rows left out), it fills columns
/// `at..at + cols` of every row of the layout's tensor viewed as rows of
/// `width` (`qkv` holds query, key and value side by side); an `nn.Linear`
/// weight (out, in) is the transpose of the layout's (in, out).
struct Stored {
    hf: String,
    shape: Vec<usize>,
    linear: bool,
    at: usize,
    cols: usize,
    width: usize,
}

/// The Hugging Face tensors layout tensor `t` is stored as: the mapping
/// both reading and writing a folder follow.
fn stored(cfg: &BertConfig, t: &TensorSpec) -> Vec<Stored> {
    let linear = t.full_shape.len() == 2 && !EMBEDDINGS.contains(&t.name.as_str());
    let mut shape = t.full_shape.clone();
    if t.name == EMBEDDINGS[0] || t.name == HEAD_MLM[4] {
        shape[0] = cfg.vocab_size;
    }
    let width = *t.full_shape.last().expect("a shape");
    let one = |hf: String, shape: Vec<usize>, at: usize| {
        let cols = *shape.last().expect("a shape");
        let shape = match linear {
            true => vec![cols, shape[0]],
            false => shape,
        };
        Stored {
            hf,
            shape,
            linear,
            at,
            cols,
            width,
        }
    };
    match t.name.split_once("attention.self.qkv") {
        Some((block, kind)) => {
            let c = cfg.n_embd;
            let part = |g: usize, name: &str| {
                let mut s = shape.clone();
                *s.last_mut().expect("a shape") = c;
                one(format!("{block}attention.self.{name}{kind}"), s, g * c)
            };
            ["query", "key", "value"]
                .iter()
                .enumerate()
                .map(|(g, name)| part(g, name))
                .collect()
        }
        None => vec![one(t.name.clone(), shape, 0)],
    }
}

/// The whole model's parameters from a Hugging Face state dict, starting
/// from `init` (BERT's initialisation) for the head tensors a file may
/// lack: a `BertModel`'s masked-LM head (the decoder is the word
/// embeddings either way) or classifier, or its pooler under an MLM head
/// (a classifier for another number of labels counts as lacking).
pub fn read_weights(cfg: &BertConfig, st: &SafeTensors, init: Vec<f32>) -> Result<Vec<f32>> {
    let lay = layout(cfg, 1);
    let mut p = init;
    // whether the file has the head part the tensor belongs to, decided at
    // the part's first tensor; the embeddings and blocks must be there
    let mut present = true;
    for t in &lay.tensors {
        let parts = stored(cfg, t);
        present = head_part(cfg, st, t)?.unwrap_or(present);
        if !present {
            continue;
        }
        for s in parts {
            let name = match t.name == HEAD_MLM[4] && find(st, HEAD_MLM[4])?.is_none() {
                true => "cls.predictions.decoder.bias",
                false => &s.hf,
            };
            let mut data = need(st, name, &s.shape)?;
            if s.linear {
                data = transpose(&data, s.shape[0], s.shape[1]);
            }
            for (i, row) in data.chunks(s.cols).enumerate() {
                let start = t.offset + i * s.width + s.at;
                p[start..start + s.cols].copy_from_slice(row);
            }
        }
    }
    Ok(p)
}

/// At the first tensor of a head part (the masked-LM head, the pooler, a
/// classifier), whether `st` holds that part (a classifier in its shape);
/// None at any other tensor.
fn head_part(cfg: &BertConfig, st: &SafeTensors, t: &TensorSpec) -> Result<Option<bool>> {
    Ok(match t.name.as_str() {
        n if n == HEAD_MLM[0] || n == "bert.pooler.dense.weight" => Some(find(st, n)?.is_some()),
        n if n == classifier_names(cfg.head)[0] => {
            let shape = &stored(cfg, t)[0].shape;
            Some(find(st, n)?.is_some_and(|(s, _)| &s == shape))
        }
        _ => None,
    })
}

/// The first part of the head a folder's model (with `head` where the
/// folder has none) scores with that its file lacks, or holds in another
/// shape: a part [`load_folder`] starts from its seed, for training on.
/// `eval` refuses such a folder (a head drawn at random scores as if it
/// were trained). A masked LM's pooler is not its head's.
pub fn untrained_head(dir: &Path, head: Option<BertHead>) -> Result<Option<String>> {
    let (cfg, path, bytes) = read_folder(dir, head)?;
    let st = parse(&path, &bytes)?;
    let pooled = cfg.head.pooled_labels().is_some();
    for t in &layout(&cfg, 1).tensors {
        let scored = pooled || t.name != "bert.pooler.dense.weight";
        if scored && head_part(&cfg, &st, t)? == Some(false) {
            return Ok(Some(t.name.clone()));
        }
    }
    Ok(None)
}

/// A folder's config (with `head` where the folder has none), and its
/// weights file's path and bytes.
fn read_folder(dir: &Path, head: Option<BertHead>) -> Result<(BertConfig, PathBuf, Vec<u8>)> {
    let cfg = read_config(dir, head)?;
    let path = dir.join("model.safetensors");
    crate::store::regular_file(&path)?;
    let bytes = std::fs::read(&path)
        .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
    Ok((cfg, path, bytes))
}

/// The weights file's tensors, or an error naming the file.
fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    read_safetensors(bytes)
        .map_err(|e| Error::checkpoint(path, format!("not a valid safetensors file: {e}")))
}

/// A Hugging Face BERT folder: its config (with `head` where the folder
/// has none) and the whole model's parameters.
pub fn load_folder(
    dir: &Path,
    head: Option<BertHead>,
    seed: u64,
) -> Result<(BertConfig, Vec<f32>)> {
    let (cfg, path, bytes) = read_folder(dir, head)?;
    let bad = |reason: String| Error::checkpoint(&path, reason);
    if let Some(want) = recorded(dir, CHECKSUM_KEY)? {
        let sum = checksum(&bytes);
        if sum != want {
            return Err(bad(format!(
                "checksum {sum} does not match {want} recorded in config.json: the weights are corrupted or were replaced"
            )));
        }
    }
    // the embeddings and every block's matrices must be in the file: a
    // config asking for more is refused before the model is allocated
    let (c, f) = (cfg.n_embd as u64, cfg.n_inner as u64);
    // (2 bytes a weight: a file saved in bf16 or fp16)
    let least = 2
        * ((cfg.vocab_size + cfg.block_size + cfg.type_vocab) as u64 * c
            + cfg.n_layer as u64 * (4 * c * c + 2 * c * f));
    let model = format!("the model config.json describes ({cfg})");
    check_holds(&path, least, &model)?;
    let st = parse(&path, &bytes)?;
    let lay = layout(&cfg, 1);
    let names = lay
        .tensors
        .iter()
        .flat_map(|t| stored(&cfg, t))
        .map(|s| s.hf);
    if let Some(reason) = no_place(names, &st, canonical, cfg.n_layer) {
        return Err(bad(reason));
    }
    // a head the file lacks is drawn fresh: its size is the config's alone
    check_fits(lay.total(), &model).map_err(bad)?;
    let params = read_weights(&cfg, &st, super::init_full(&cfg, seed))?;
    if let Some(i) = params.iter().position(|x| !x.is_finite()) {
        let lay = layout(&cfg, 1);
        let name = lay
            .tensors
            .iter()
            .find(|t| t.range().contains(&i))
            .map_or("?", |t| t.name.as_str());
        return Err(bad(format!(
            "tensor '{name}' holds a non-finite weight ({}): refusing to use it",
            params[i]
        )));
    }
    Ok((cfg, params))
}

/// A tensor's name as [`find`] reads it: without `bert.`, and an old
/// LayerNorm's `gamma` and `beta` as `weight` and `bias`.
fn canonical(name: &str) -> String {
    let name = name.strip_prefix("bert.").unwrap_or(name);
    LEGACY_NAMES
        .iter()
        .find_map(|(now, then)| name.strip_suffix(then).map(|at| format!("{at}{now}")))
        .unwrap_or_else(|| name.to_string())
}

/// The key of `config.json` under which distgpt records the weights' checksum.
const CHECKSUM_KEY: &str = "distgpt_weights_checksum";

/// The checksum under `key` of `config.json` a folder distgpt wrote
/// records (None for one written elsewhere; one that is not a string is
/// refused, not taken for none and the check skipped).
fn recorded(dir: &Path, key: &str) -> Result<Option<String>> {
    let (path, j) = read_hf_config(dir)?;
    match &j[key] {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(sum) => Ok(Some(sum.clone())),
        other => Err(Error::checkpoint(
            &path,
            format!("{key} is {other}, not a checksum: the file was edited or corrupted"),
        )),
    }
}

/// The key of `config.json` under which distgpt records, beside the
/// weights', the checksum of the vocabulary written with them
/// ([`WordPiece::checksum`]).
const VOCAB_CHECKSUM_KEY: &str = "distgpt_vocab_checksum";

/// A BERT folder's WordPiece tokenizer ([`WordPiece::from_folder`]),
/// checked against the vocabulary checksum its `config.json` records where
/// distgpt wrote the folder: weights read with another vocabulary's ids
/// would run and be wrong.
pub fn read_vocab(dir: &Path) -> Result<WordPiece> {
    let wp = WordPiece::from_folder(dir)?;
    if let Some(want) = recorded(dir, VOCAB_CHECKSUM_KEY)? {
        if wp.checksum() != want {
            return Err(Error::Input(format!(
                "{}: checksum {} does not match {want} recorded beside the weights in {}: \
                 the vocabulary was replaced or is not this model's; put back the vocab.txt \
                 the folder was written with",
                dir.join("vocab.txt").display(),
                wp.checksum(),
                dir.join("config.json").display()
            )));
        }
    }
    Ok(wp)
}

/// The Hugging Face tensors of the whole model's parameters `p`, by
/// [`stored`]: (name, shape, values).
fn hf_tensors(cfg: &BertConfig, p: &[f32]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let lay = layout(cfg, 1);
    let mut out = Vec::new();
    for t in &lay.tensors {
        for s in stored(cfg, t) {
            let rows = s.shape.iter().product::<usize>() / s.cols;
            let at = |i: usize| t.offset + i * s.width + s.at;
            let data: Vec<f32> = (0..rows)
                .flat_map(|i| p[at(i)..at(i) + s.cols].iter().copied())
                .collect();
            let data = match s.linear {
                true => transpose(&data, rows, s.cols),
                false => data,
            };
            out.push((s.hf, s.shape, data));
        }
    }
    out
}

/// Writes a Hugging Face folder `transformers` loads:
/// `config.json` (`BertForMaskedLM` / `BertForSequenceClassification`),
/// `model.safetensors`, and, when `vocab` is given, the files
/// `AutoTokenizer.from_pretrained` reads: `vocab.txt`,
/// `tokenizer_config.json` (a `BertTokenizer` normalizing as `vocab` does)
/// and `special_tokens_map.json`.
pub fn write_folder(
    cfg: &BertConfig,
    params: &[f32],
    vocab: Option<&WordPiece>,
    labels: &[String],
    dir: &Path,
) -> Result<()> {
    let io = |e: std::io::Error| Error::Input(format!("cannot write {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tensors = hf_tensors(cfg, params);
    let tensors: Vec<_> = tensors
        .iter()
        .map(|(n, s, d)| (n.clone(), Dtype::F32, s.clone(), Data::F32(d)))
        .collect();
    // the weights first, then the config that vouches for them: a folder
    // cut short anywhere fails its check on load
    let sum = write_safetensors(&dir.join("model.safetensors"), &tensors)?;
    let (arch, n_labels) = (
        cfg.head.architecture(),
        cfg.head.pooled_labels().unwrap_or(2),
    );
    // [PAD]'s id in the vocabulary; none for characters, whose id 0 is a
    // character (transformers freezes the input embedding of the pad id)
    let pad = vocab.map(|wp| wp.pad);
    let mut config = serde_json::json!({
        "architectures": [arch],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.n_inner,
        "hidden_act": "gelu",
        "max_position_embeddings": cfg.block_size,
        "type_vocab_size": cfg.type_vocab,
        "layer_norm_eps": cfg.layer_norm_eps,
        // distgpt trains without dropout; so does this file, as read again
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "pad_token_id": pad,
        "num_labels": n_labels,
        "position_embedding_type": "absolute",
        CHECKSUM_KEY: sum,
    });
    if !labels.is_empty() {
        if cfg.head.pooled_labels() != Some(labels.len()) {
            return Err(Error::Config(format!(
                "{} label names for a {cfg}",
                labels.len()
            )));
        }
        let id2label: serde_json::Map<_, _> = (labels.iter().enumerate())
            .map(|(i, l)| (i.to_string(), l.as_str().into()))
            .collect();
        let label2id: serde_json::Map<_, _> = (labels.iter().enumerate())
            .map(|(i, l)| (l.clone(), i.into()))
            .collect();
        config["id2label"] = id2label.into();
        config["label2id"] = label2id.into();
    }
    if let Some(wp) = vocab {
        write_tokenizer(wp, cfg.block_size, dir)?;
        config[VOCAB_CHECKSUM_KEY] = wp.checksum().into();
    }
    write_json(&dir.join("config.json"), &config).map(drop)
}

/// The files `AutoTokenizer.from_pretrained` reads for `wp`: `vocab.txt`,
/// `tokenizer_config.json` (a `BertTokenizer` normalizing as `wp` does,
/// for `block_size` positions) and `special_tokens_map.json`.
fn write_tokenizer(wp: &WordPiece, block_size: usize, dir: &Path) -> Result<()> {
    write_atomic(&dir.join("vocab.txt"), wp.vocab_text().as_bytes())?;
    let normalizer = wp.normalizer();
    let special = serde_json::json!({
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    });
    let mut tokenizer = special.clone();
    let extra = serde_json::json!({
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": normalizer.lowercase,
        "tokenize_chinese_chars": normalizer.chinese_chars,
        "strip_accents": normalizer.strip_accents,
        "model_max_length": block_size,
    });
    for (k, v) in extra.as_object().expect("an object") {
        tokenizer[k] = v.clone();
    }
    for (name, j) in [
        ("tokenizer_config.json", tokenizer),
        ("special_tokens_map.json", special),
    ] {
        write_json(&dir.join(name), &j)?;
    }
    Ok(())
}

/// A bert-tiny folder with `head`, sized for `wp`'s vocabulary and 16
/// positions, freshly initialised, written to `dir` (tests).
#[cfg(test)]
pub(crate) fn write_tiny(wp: &WordPiece, head: super::BertHead, dir: &Path) {
    let cfg = BertConfig {
        vocab_size: wp.vocab_size(),
        block_size: 16,
        head,
        ..BertConfig::preset("bert-tiny").unwrap()
    };
    write_folder(&cfg, &super::init_full(&cfg, 1), Some(wp), &[], dir).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_without_a_head_says_how_to_get_one() {
        let dir = crate::testdir::TestDir::new("headless");
        let config = r#"{"model_type": "bert", "architectures": ["BertModel"]}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let e = read_config(dir.path(), None).unwrap_err().to_string();
        assert!(e.contains("a BertModel has no head"), "{e}");
        assert!(
            e.contains("train --task classify --init-from DIR --data SET"),
            "{e}"
        );
    }

    /// An optional setting of the wrong type is refused, naming it: a
    /// string `layer_norm_eps` read as the default 1e-12, a number
    /// `hidden_act` as gelu.
    #[test]
    fn an_optional_setting_of_the_wrong_type_is_refused_naming_it() {
        let dir = crate::testdir::TestDir::new("bert-config-types");
        let config = |extra: &str| {
            let text = format!(
                r#"{{"model_type": "bert", "architectures": ["BertForMaskedLM"],
                "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8,
                "intermediate_size": 12, "max_position_embeddings": 5,
                "type_vocab_size": 2, "vocab_size": 8{extra}}}"#
            );
            std::fs::write(dir.path().join("config.json"), text).unwrap();
            read_config(dir.path(), None)
        };
        let eps = config(r#", "layer_norm_eps": 0.001, "hidden_act": "gelu""#).unwrap();
        assert_eq!(eps.layer_norm_eps, 0.001);
        assert_eq!(config("").unwrap().layer_norm_eps, 1e-12);
        for (extra, says) in [
            (
                r#", "layer_norm_eps": "0.1""#,
                r#"layer_norm_eps is "0.1", not a number"#,
            ),
            (r#", "hidden_act": 5"#, "hidden_act is 5, not a string"),
            (
                r#", "position_embedding_type": true"#,
                "position_embedding_type is true, not a string",
            ),
        ] {
            let e = config(extra).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
    }

    /// A one-block BERT 8 wide of `vocab_size` words under `head`.
    fn one_block(vocab_size: usize, head: BertHead) -> BertConfig {
        BertConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            n_inner: 12,
            block_size: 5,
            type_vocab: 2,
            vocab_size,
            layer_norm_eps: 1e-12,
            head,
        }
    }

    /// A config.json the weights beside it do not fit is refused before
    /// the model is allocated: fewer layers than the file holds (the rest
    /// were dropped without a word), token types past what the file holds
    /// and labels past the machine's memory (each an allocation's abort).
    #[test]
    fn a_config_the_weights_beside_it_do_not_fit_is_refused_saying_why() {
        let mut cfg = one_block(8, BertHead::Classify { labels: 2 });
        cfg.n_layer = 2;
        let p = super::super::init_full(&cfg, 4);
        let dir = crate::testdir::TestDir::new("bert-config-disagrees");
        write_folder(&cfg, &p, None, &[], dir.path()).unwrap();
        let (_, back) = load_folder(dir.path(), None, 0).unwrap();
        assert_eq!(back, p);
        let path = dir.path().join("config.json");
        let original: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let edited = |key: &str, value: u64| {
            let mut j = original.clone();
            j[key] = value.into();
            if let Some(m) = j.as_object_mut() {
                m.remove("id2label");
                m.remove("label2id");
            }
            std::fs::write(&path, j.to_string()).unwrap();
            let e = load_folder(dir.path(), None, 0).map(|_| ()).unwrap_err();
            e.to_string()
        };
        for (key, value, says) in [
            ("num_hidden_layers", 1, "'bert.encoder.layer.1."),
            ("type_vocab_size", 100_000_000, "cannot hold"),
            // 5.4e10 parameters: 216 GB in fp32
            ("num_labels", 6_000_000_000, "of memory available"),
        ] {
            let e = edited(key, value);
            assert!(e.contains(says), "{key} {value}: {e}");
        }
    }

    #[test]
    fn a_vocabulary_replaced_beside_the_weights_is_refused_naming_it() {
        let cfg = one_block(8, BertHead::Mlm);
        let p = super::super::init_full(&cfg, 4);
        let tokens = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "yes", "no", "maybe",
        ];
        let wp = WordPiece::new(tokens.map(String::from).to_vec()).unwrap();
        let dir = crate::testdir::TestDir::new("bert-vocab-swap");
        write_folder(&cfg, &p, Some(&wp), &[], dir.path()).unwrap();
        let import = super::super::family::FAMILY.hf.unwrap().import;
        let (meta, _) = import(dir.path()).unwrap();
        assert_eq!(meta.tokenizer, wp.spec());
        // the same size, two tokens swapped: every id of "yes" and "no" would be wrong
        let swapped = wp.vocab_text().replace("yes\nno", "no\nyes");
        std::fs::write(dir.path().join("vocab.txt"), swapped).unwrap();
        for err in [read_vocab(dir.path()).err(), import(dir.path()).err()] {
            let err = err.expect("a replaced vocabulary is refused").to_string();
            assert!(
                err.contains("vocab.txt: checksum") && err.contains("config.json"),
                "{err}"
            );
        }
    }

    /// A checksum distgpt records that is not a string (an edit, a
    /// corruption) is refused naming it: it read as no checksum, and the
    /// weights or the vocabulary loaded unchecked.
    #[test]
    fn a_recorded_checksum_that_is_not_a_string_is_refused() {
        let cfg = one_block(8, BertHead::Mlm);
        let p = super::super::init_full(&cfg, 4);
        let tokens = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "yes", "no", "maybe",
        ];
        let wp = WordPiece::new(tokens.map(String::from).to_vec()).unwrap();
        let dir = crate::testdir::TestDir::new("bert-checksum-type");
        let import = super::super::family::FAMILY.hf.unwrap().import;
        for key in [CHECKSUM_KEY, VOCAB_CHECKSUM_KEY] {
            write_folder(&cfg, &p, Some(&wp), &[], dir.path()).unwrap();
            let mut config = read_hf_config(dir.path()).unwrap().1;
            config[key] = 5.into();
            std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
            let err = import(dir.path()).expect_err("refused").to_string();
            assert!(
                err.contains("config.json") && err.contains(&format!("{key} is 5, not a checksum")),
                "{err}"
            );
        }
    }

    /// A folder saved in half precision (`model.to(torch.bfloat16)
    /// .save_pretrained`, or fp16) loads as its values widened: every
    /// weight the fp32 folder's, rounded by the `half` crate.
    #[test]
    fn a_folder_saved_in_bf16_or_fp16_loads_as_its_values_widened() {
        // a vocabulary whose rows are most of the file: half its fp32 size
        // must be enough
        let cfg = one_block(2000, BertHead::Classify { labels: 2 });
        let mut p = super::super::init_full(&cfg, 4);
        p.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x += i as f32 * 1e-3 + 1e-7);
        let lay = layout(&cfg, 1);
        let word = lay.tensor(EMBEDDINGS[0]).unwrap().range();
        p[word.start + cfg.vocab_size * cfg.n_embd..word.end].fill(0.0);
        let root = crate::testdir::TestDir::new("bert-hf-half");
        let dir = root.path().join("model");
        write_folder(&cfg, &p, None, &[], &dir).unwrap();
        let path = dir.join("model.safetensors");
        let fp32 = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&fp32).unwrap();
        // a file saved so carries no checksum of distgpt's
        let mut config = read_hf_config(&dir).unwrap().1;
        config.as_object_mut().unwrap().remove(CHECKSUM_KEY);
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        // each value's bits in the file, and the value they widen to
        type Round = fn(f32) -> (u16, f32);
        let bf16: Round = |x| {
            let h = half::bf16::from_f32(x);
            (h.to_bits(), h.to_f32())
        };
        let f16: Round = |x| {
            let h = half::f16::from_f32(x);
            (h.to_bits(), h.to_f32())
        };
        for (dtype, round) in [(Dtype::BF16, bf16), (Dtype::F16, f16)] {
            let tensors: Vec<_> = st
                .tensors()
                .into_iter()
                .map(|(name, v)| {
                    let bytes = v.data().chunks_exact(4).flat_map(|b| {
                        round(f32::from_le_bytes(b.try_into().unwrap()))
                            .0
                            .to_le_bytes()
                    });
                    (
                        name,
                        dtype,
                        v.shape().to_vec(),
                        Data::Bytes(bytes.collect()),
                    )
                })
                .collect();
            write_safetensors(&path, &tensors).unwrap();
            let (_, back) = load_folder(&dir, None, 9).unwrap();
            let want: Vec<f32> = p.iter().map(|&x| round(x).1).collect();
            assert_eq!(back, want, "{dtype:?}");
            assert_ne!(back, p, "{dtype:?}: the rounding is visible");
        }
    }

    /// A file that names its LayerNorms' weights and biases as Google's
    /// TensorFlow checkpoints did (`LayerNorm.gamma`, `LayerNorm.beta`: the
    /// hub's `bert-base-uncased`), with or without the `bert.` prefix, reads
    /// as the same parameters.
    #[test]
    fn layernorms_named_gamma_and_beta_read_as_their_weights_and_biases() {
        let cfg = one_block(40, BertHead::Mlm);
        let p = super::super::init_full(&cfg, 5);
        let root = crate::testdir::TestDir::new("bert-hf-gamma");
        let dir = root.path().join("model");
        write_folder(&cfg, &p, None, &[], &dir).unwrap();
        let mut config = read_hf_config(&dir).unwrap().1;
        config.as_object_mut().unwrap().remove(CHECKSUM_KEY);
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        for prefix in ["", "bert."] {
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let mut renamed = 0;
            let tensors: Vec<_> = st
                .tensors()
                .into_iter()
                .map(|(name, v)| {
                    let old = name
                        .replace("LayerNorm.weight", "LayerNorm.gamma")
                        .replace("LayerNorm.bias", "LayerNorm.beta");
                    renamed += usize::from(old != name);
                    let old = match old.strip_prefix("bert.") {
                        Some(short) => format!("{prefix}{short}"),
                        None => old,
                    };
                    let data = Data::Bytes(v.data().to_vec());
                    (old, Dtype::F32, v.shape().to_vec(), data)
                })
                .collect();
            assert!(renamed >= 6, "{renamed} LayerNorm tensors renamed");
            write_safetensors(&path, &tensors).unwrap();
            let (_, back) = load_folder(&dir, None, 9).unwrap();
            assert!(back == p, "prefix {prefix:?}");
        }
    }

    #[test]
    fn a_written_folder_reads_back_to_the_same_parameters() {
        for head in [
            BertHead::Mlm,
            BertHead::Classify { labels: 3 },
            BertHead::Pretrain,
        ] {
            let cfg = BertConfig {
                n_layer: 2,
                n_head: 2,
                n_embd: 8,
                n_inner: 12,
                block_size: 5,
                type_vocab: 2,
                vocab_size: 70,
                layer_norm_eps: 1e-12,
                head,
            };
            let mut p = super::super::init_full(&cfg, 4);
            p.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += i as f32 * 1e-3);
            let lay = layout(&cfg, 1);
            let word = lay.tensor(EMBEDDINGS[0]).unwrap().range();
            p[word.start + cfg.vocab_size * cfg.n_embd..word.end].fill(0.0);
            if head.has_mlm() {
                let bias = lay.tensor("cls.predictions.bias").unwrap().range();
                p[bias.start + cfg.vocab_size..bias.end].fill(0.0);
            }
            let root = crate::testdir::TestDir::new(&format!("bert-hf-{head:?}"));
            let dir = root.path().join("model");
            write_folder(&cfg, &p, None, &[], &dir).unwrap();
            let (cfg2, back) = load_folder(&dir, None, 9).unwrap();
            assert_eq!(cfg2, cfg);
            assert_eq!(back, p, "{head:?}");
            // characters have no [PAD]; a vocabulary names its own
            let config = |dir: &Path| -> serde_json::Value {
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap()
            };
            assert_eq!(config(&dir)["pad_token_id"], serde_json::Value::Null);
            let vocab = "[UNK]\n[PAD]\n[CLS]\n[SEP]\n[MASK]\n";
            let wp = WordPiece::new(vocab.lines().map(String::from).collect()).unwrap();
            let with = root.path().join("with-vocab");
            write_folder(&cfg, &p, Some(&wp), &[], &with).unwrap();
            assert_eq!(config(&with)["pad_token_id"], 1);
            assert_eq!(
                std::fs::read_to_string(with.join("vocab.txt")).unwrap(),
                vocab
            );
            // what AutoTokenizer reads beside it: an uncased BertTokenizer
            let json = |name: &str| -> serde_json::Value {
                serde_json::from_str(&std::fs::read_to_string(with.join(name)).unwrap()).unwrap()
            };
            let tok = json("tokenizer_config.json");
            assert_eq!(tok["tokenizer_class"], "BertTokenizer");
            assert_eq!(
                (&tok["do_lower_case"], &tok["mask_token"]),
                (&true.into(), &"[MASK]".into())
            );
            assert_eq!(json("special_tokens_map.json")["cls_token"], "[CLS]");
            assert!(!dir.join("tokenizer_config.json").exists());
            assert_eq!(read_vocab(&with).unwrap().vocab_text(), vocab);
        }
    }
}
