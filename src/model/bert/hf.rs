//! Hugging Face BERT folders in: `config.json` (`BertConfig`) and
//! `model.safetensors` of a `BertModel` (names without `bert.`),
//! `BertForMaskedLM`, `BertForPreTraining` or
//! `BertForSequenceClassification`. `nn.Linear`
//! weights (out, in) are transposed to the layout's (in, out); query, key
//! and value are joined into `qkv`.

use super::config::{BertConfig, BertHead};
use super::layout::{classifier_names, layout, BlockParam, EMBEDDINGS, HEAD_MLM};
use crate::error::{Error, Result};
use crate::store::checksum;
use crate::store::write_atomic;
use safetensors::tensor::{Dtype, SafeTensors};
use std::path::Path;

/// The config of a Hugging Face BERT folder; `head` replaces the one its
/// architecture implies (a `BertModel` implies none, so it must be given).
pub fn read_config(dir: &Path, head: Option<BertHead>) -> Result<BertConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
    let j: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Input(format!("{} is not JSON: {e}", path.display())))?;
    let bad = |what: &str| Error::Input(format!("{}: {what}", path.display()));
    if j["model_type"].as_str() != Some("bert") {
        return Err(bad("model_type is not \"bert\""));
    }
    let get = |k: &str| {
        j[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| bad(&format!("{k} is missing or not a whole number")))
    };
    match j["hidden_act"].as_str() {
        Some("gelu") | None => {}
        Some(other) => {
            return Err(bad(&format!(
                "hidden_act {other} is not supported (gelu only)"
            )))
        }
    }
    if j["position_embedding_type"]
        .as_str()
        .is_some_and(|p| p != "absolute")
    {
        return Err(bad("only absolute position embeddings are supported"));
    }
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
            "a {arch} has no head (a masked LM's or a classifier's): fine-tune a classifier from it with `train --task classify --init-from DIR --data SET`, or pretrain it further with `train --task mlm --init-from DIR --data TEXT`; `eval` reads a BertForMaskedLM, BertForPreTraining or BertForSequenceClassification folder"
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
        layer_norm_eps: j["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32,
        head,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The block tensors stored as they are (no transpose, no join).
const PLAIN: [BlockParam; 7] = [
    BlockParam::AttnOutB,
    BlockParam::AttnLnW,
    BlockParam::AttnLnB,
    BlockParam::InterB,
    BlockParam::OutB,
    BlockParam::OutLnW,
    BlockParam::OutLnB,
];

/// A tensor of the file as f32 with its shape, under `name` or, for a
/// `BertModel`'s file, `name` without its `bert.` prefix.
fn find(st: &SafeTensors, name: &str) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
    let short = name.strip_prefix("bert.");
    let view = match st.tensor(name) {
        Ok(v) => v,
        Err(_) => match short.and_then(|s| st.tensor(s).ok()) {
            Some(v) => v,
            None => return Ok(None),
        },
    };
    if view.dtype() != Dtype::F32 {
        return Err(Error::Input(format!(
            "tensor {name} is {:?}; float32 checkpoints only",
            view.dtype()
        )));
    }
    let data = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
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

/// The whole model's parameters from a Hugging Face state dict, starting
/// from `init` (BERT's initialisation) for the head tensors a file may
/// lack: a `BertModel`'s classifier, or its pooler under an MLM head (a
/// classifier for another number of labels counts as lacking).
pub fn read_weights(cfg: &BertConfig, st: &SafeTensors, init: Vec<f32>) -> Result<Vec<f32>> {
    let lay = layout(cfg, 1);
    let mut p = init;
    let (c, f, vp, v) = (cfg.n_embd, cfg.n_inner, cfg.padded_vocab(), cfg.vocab_size);
    let mut put = |name: &str, data: &[f32]| {
        let r = lay.tensor(name).expect("declared").range();
        p[r.start..r.start + data.len()].copy_from_slice(data);
    };
    put(EMBEDDINGS[0], &need(st, EMBEDDINGS[0], &[v, c])?);
    put(
        EMBEDDINGS[1],
        &need(st, EMBEDDINGS[1], &[cfg.block_size, c])?,
    );
    put(
        EMBEDDINGS[2],
        &need(st, EMBEDDINGS[2], &[cfg.type_vocab, c])?,
    );
    put(EMBEDDINGS[3], &need(st, EMBEDDINGS[3], &[c])?);
    put(EMBEDDINGS[4], &need(st, EMBEDDINGS[4], &[c])?);
    let linear = |name: &str, out: usize, inp: usize| -> Result<Vec<f32>> {
        Ok(transpose(&need(st, name, &[out, inp])?, out, inp))
    };
    for l in 0..cfg.n_layer {
        let hf = |s: &str| format!("bert.encoder.layer.{l}.{s}");
        let ours = |bp: BlockParam| format!("bert.encoder.layer.{l}.{}", bp.name());
        let (mut qkv_w, mut qkv_b) = (vec![0.0; c * 3 * c], Vec::with_capacity(3 * c));
        for (g, part) in ["query", "key", "value"].iter().enumerate() {
            let w = linear(&hf(&format!("attention.self.{part}.weight")), c, c)?;
            for i in 0..c {
                qkv_w[i * 3 * c + g * c..i * 3 * c + (g + 1) * c]
                    .copy_from_slice(&w[i * c..(i + 1) * c]);
            }
            qkv_b.extend(need(st, &hf(&format!("attention.self.{part}.bias")), &[c])?);
        }
        put(&ours(BlockParam::QkvW), &qkv_w);
        put(&ours(BlockParam::QkvB), &qkv_b);
        put(
            &ours(BlockParam::AttnOutW),
            &linear(&hf("attention.output.dense.weight"), c, c)?,
        );
        put(
            &ours(BlockParam::InterW),
            &linear(&hf("intermediate.dense.weight"), f, c)?,
        );
        put(
            &ours(BlockParam::OutW),
            &linear(&hf("output.dense.weight"), c, f)?,
        );
        for bp in PLAIN {
            let shape = bp.shape(c, f);
            put(&ours(bp), &need(st, &ours(bp), &shape)?);
        }
    }
    // A BertModel (all-MiniLM-L6-v2's folder) has no masked-LM head: it
    // starts fresh from `init`, as transformers makes one; the decoder is
    // the word embeddings either way.
    if cfg.head.has_mlm() && find(st, HEAD_MLM[0])?.is_some() {
        put(HEAD_MLM[0], &linear(HEAD_MLM[0], c, c)?);
        for name in &HEAD_MLM[1..4] {
            put(name, &need(st, name, &[c])?);
        }
        let bias = match find(st, HEAD_MLM[4])? {
            Some(_) => need(st, HEAD_MLM[4], &[v])?,
            None => need(st, "cls.predictions.decoder.bias", &[v])?,
        };
        put(HEAD_MLM[4], &bias);
        debug_assert!(vp >= v);
    }
    if let Some(labels) = cfg.head.pooled_labels() {
        // A BertModel has a pooler and no classifier: the classifier starts fresh.
        if find(st, "bert.pooler.dense.weight")?.is_some() {
            put(
                "bert.pooler.dense.weight",
                &linear("bert.pooler.dense.weight", c, c)?,
            );
            put(
                "bert.pooler.dense.bias",
                &need(st, "bert.pooler.dense.bias", &[c])?,
            );
        }
        // A classifier for another number of labels is replaced by a fresh one.
        let [w, b] = classifier_names(cfg.head);
        if find(st, w)?.is_some_and(|(s, _)| s == [labels, c]) {
            put(w, &linear(w, labels, c)?);
            put(b, &need(st, b, &[labels])?);
        }
    }
    Ok(p)
}

/// A Hugging Face BERT folder: its config (with `head` where the folder
/// has none) and the whole model's parameters.
pub fn load_folder(
    dir: &Path,
    head: Option<BertHead>,
    seed: u64,
) -> Result<(BertConfig, Vec<f32>)> {
    let cfg = read_config(dir, head)?;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path)
        .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
    let bad = |reason: String| Error::Checkpoint {
        path: path.clone(),
        reason,
    };
    if let Some(want) = recorded_checksum(dir)? {
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
    let least = 4
        * (cfg.vocab_size as u64 * c
            + cfg.block_size as u64 * c
            + cfg.n_layer as u64 * (4 * c * c + 2 * c * f));
    if (bytes.len() as u64) < least {
        return Err(bad(format!(
            "{} bytes cannot hold the {least} bytes of weights config.json describes ({cfg}): the file is cut short or the config is wrong",
            bytes.len()
        )));
    }
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Input(format!("{} is not a safetensors file: {e}", path.display())))?;
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

/// The key of `config.json` under which distgpt records the weights' checksum.
const CHECKSUM_KEY: &str = "distgpt_weights_checksum";

/// The weights' checksum a folder distgpt wrote records (None for one
/// written elsewhere).
fn recorded_checksum(dir: &Path) -> Result<Option<String>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::Input(format!("cannot read {}: {e}", path.display())))?;
    let j: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Input(format!("{} is not JSON: {e}", path.display())))?;
    Ok(j[CHECKSUM_KEY].as_str().map(str::to_string))
}

fn hf_tensors(cfg: &BertConfig, p: &[f32]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let lay = layout(cfg, 1);
    let (c, f, v) = (cfg.n_embd, cfg.n_inner, cfg.vocab_size);
    let get = |name: &str| &p[lay.tensor(name).expect("declared").range()];
    let mut out = Vec::new();
    let mut plain = |name: &str, shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        out.push((name.to_string(), shape, get(name)[..n].to_vec()));
    };
    plain(EMBEDDINGS[0], vec![v, c]);
    plain(EMBEDDINGS[1], vec![cfg.block_size, c]);
    plain(EMBEDDINGS[2], vec![cfg.type_vocab, c]);
    plain(EMBEDDINGS[3], vec![c]);
    plain(EMBEDDINGS[4], vec![c]);
    for l in 0..cfg.n_layer {
        let ours = |bp: BlockParam| format!("bert.encoder.layer.{l}.{}", bp.name());
        for bp in PLAIN {
            plain(&ours(bp), bp.shape(c, f));
        }
    }
    let linear = |name: &str, hf: &str, inp: usize, outw: usize| {
        (
            hf.to_string(),
            vec![outw, inp],
            transpose(get(name), inp, outw),
        )
    };
    for l in 0..cfg.n_layer {
        let ours = |bp: BlockParam| format!("bert.encoder.layer.{l}.{}", bp.name());
        let hf = |s: &str| format!("bert.encoder.layer.{l}.{s}");
        let (qkv_w, qkv_b) = (get(&ours(BlockParam::QkvW)), get(&ours(BlockParam::QkvB)));
        for (g, part) in ["query", "key", "value"].iter().enumerate() {
            let mut w = vec![0.0; c * c];
            for i in 0..c {
                w[i * c..(i + 1) * c]
                    .copy_from_slice(&qkv_w[i * 3 * c + g * c..i * 3 * c + (g + 1) * c]);
            }
            out.push((
                hf(&format!("attention.self.{part}.weight")),
                vec![c, c],
                transpose(&w, c, c),
            ));
            out.push((
                hf(&format!("attention.self.{part}.bias")),
                vec![c],
                qkv_b[g * c..(g + 1) * c].to_vec(),
            ));
        }
        out.push(linear(
            &ours(BlockParam::AttnOutW),
            &hf("attention.output.dense.weight"),
            c,
            c,
        ));
        out.push(linear(
            &ours(BlockParam::InterW),
            &hf("intermediate.dense.weight"),
            c,
            f,
        ));
        out.push(linear(
            &ours(BlockParam::OutW),
            &hf("output.dense.weight"),
            f,
            c,
        ));
    }
    if cfg.head.has_mlm() {
        out.push(linear(HEAD_MLM[0], HEAD_MLM[0], c, c));
        for name in &HEAD_MLM[1..4] {
            out.push((name.to_string(), vec![c], get(name).to_vec()));
        }
        out.push((HEAD_MLM[4].into(), vec![v], get(HEAD_MLM[4])[..v].to_vec()));
    }
    if let Some(labels) = cfg.head.pooled_labels() {
        out.push(linear(
            "bert.pooler.dense.weight",
            "bert.pooler.dense.weight",
            c,
            c,
        ));
        out.push((
            "bert.pooler.dense.bias".into(),
            vec![c],
            get("bert.pooler.dense.bias").to_vec(),
        ));
        let [w, b] = classifier_names(cfg.head);
        out.push(linear(w, w, c, labels));
        out.push((b.into(), vec![labels], get(b).to_vec()));
    }
    out
}

/// Writes a Hugging Face folder `transformers` loads:
/// `config.json` (`BertForMaskedLM` / `BertForSequenceClassification`),
/// `model.safetensors`, and, when `vocab` (a `vocab.txt`'s text) is given,
/// the files `AutoTokenizer.from_pretrained` reads: `vocab.txt`,
/// `tokenizer_config.json` (an uncased `BertTokenizer`) and
/// `special_tokens_map.json`.
pub fn write_folder(
    cfg: &BertConfig,
    params: &[f32],
    vocab: Option<&str>,
    dir: &Path,
) -> Result<()> {
    let io = |e: std::io::Error| Error::Input(format!("cannot write {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tensors = hf_tensors(cfg, params);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)
                .expect("shape and bytes agree");
            (n.clone(), view)
        })
        .collect();
    let data = safetensors::serialize(views, &None)
        .map_err(|e| Error::Input(format!("cannot serialise the weights: {e}")))?;
    // the weights first, then the config that vouches for them: a folder
    // cut short anywhere fails its check on load
    let sum = checksum(&data);
    write_atomic(&dir.join("model.safetensors"), &data)?;
    let (arch, labels) = (
        cfg.head.architecture(),
        cfg.head.pooled_labels().unwrap_or(2),
    );
    // [PAD]'s id in the vocabulary; none for characters, whose id 0 is a
    // character (transformers freezes the input embedding of the pad id)
    let pad = vocab.and_then(|text| text.lines().position(|l| l.trim_end() == "[PAD]"));
    let config = serde_json::json!({
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
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "pad_token_id": pad,
        "num_labels": labels,
        "position_embedding_type": "absolute",
        CHECKSUM_KEY: sum,
    });
    if let Some(text) = vocab {
        write_atomic(&dir.join("vocab.txt"), text.as_bytes())?;
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
            "do_lower_case": true,
            "tokenize_chinese_chars": true,
            "strip_accents": null,
            "model_max_length": cfg.block_size,
        });
        for (k, v) in extra.as_object().expect("an object") {
            tokenizer[k] = v.clone();
        }
        for (name, j) in [
            ("tokenizer_config.json", tokenizer),
            ("special_tokens_map.json", special),
        ] {
            let text = serde_json::to_string_pretty(&j).expect("JSON");
            write_atomic(&dir.join(name), text.as_bytes())?;
        }
    }
    let text = serde_json::to_string_pretty(&config).expect("a JSON value serialises");
    write_atomic(&dir.join("config.json"), text.as_bytes())
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
            write_folder(&cfg, &p, None, &dir).unwrap();
            let (cfg2, back) = load_folder(&dir, None, 9).unwrap();
            assert_eq!(cfg2, cfg);
            assert_eq!(back, p, "{head:?}");
            // characters have no [PAD]; a vocabulary names its own
            let config = |dir: &Path| -> serde_json::Value {
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap()
            };
            assert_eq!(config(&dir)["pad_token_id"], serde_json::Value::Null);
            let vocab = "[UNK]\n[PAD]\n[CLS]\n";
            let with = root.path().join("with-vocab");
            write_folder(&cfg, &p, Some(vocab), &with).unwrap();
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
        }
    }
}
