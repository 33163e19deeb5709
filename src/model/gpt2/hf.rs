//! Hugging Face interop: a folder with `config.json` (GPT2Config fields),
//! `model.safetensors` and the tokenizer's files, which
//! `GPT2LMHeadModel.from_pretrained` and `AutoTokenizer` load, and the
//! reverse, so GPT-2 checkpoints made elsewhere can be fine-tuned here.

use crate::backend::Backend;
use crate::data::{Tokenizer, TokenizerSpec};
use crate::error::{Error, Result};
use crate::model::files::{
    check_holds, read_hf_config, read_weights, write_weights, ModelMeta, HF_CONFIG, WEIGHTS_FILE,
};
use crate::model::{Gpt2, GptConfig};
use crate::store::{write_atomic, write_json};
use serde_json::{json, Value};
use std::path::Path;

/// Writes `config.json`, `model.safetensors` and the tokenizer's files
/// ([`Tokenizer::hf_files`]) into `dir`. The tokenizer is also recorded
/// under `distgpt_tokenizer`, a key `transformers` keeps and ignores.
/// A row-pruned model is written in its dense shape, the pruned rows zero
/// ([`super::rows::unshrink`]): `transformers` has no per-layer widths.
pub fn export<B: Backend>(model: &Gpt2<B>, tokenizer: &TokenizerSpec, dir: &Path) -> Result<()> {
    export_params(&model.config, &model.params_host()?, tokenizer, dir)
}

/// [`export`] of a GPT-2's whole parameters.
pub fn export_params(
    c: &GptConfig,
    params: &[f32],
    tokenizer: &TokenizerSpec,
    dir: &Path,
) -> Result<()> {
    if !c.blocks.is_empty() {
        let (dense, params) = super::rows::unshrink(c, params);
        return export_params(&dense, &params, tokenizer, dir);
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    // a character vocabulary has no end of text: its id 0 is a character
    // (often the newline), which `generate()` would stop at
    let eos = match tokenizer {
        TokenizerSpec::Gpt2 => Some(crate::data::tokenizer::GPT2_EOT),
        TokenizerSpec::Char { .. } => None,
        TokenizerSpec::WordPiece { .. } => {
            return Err(Error::Config(
                "a GPT-2 folder records char or gpt2 tokens, not a WordPiece vocabulary".into(),
            ))
        }
    };
    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
        "distgpt_tokenizer": tokenizer,
    });
    write_weights(&c.clone().into(), params, &dir.join(WEIGHTS_FILE), false)?;
    for (name, text) in Tokenizer::from_spec(tokenizer)?.hf_files(c.block_size) {
        write_atomic(&dir.join(name), text.as_bytes())?;
    }
    write_json(&dir.join(HF_CONFIG), &config).map(drop)
}

/// Why `config.json`'s fields describe another model than the GPT-2
/// distgpt computes, if they do: the fields whose other values
/// `transformers` computes another model with (absent or null: its
/// defaults, which are distgpt's).
fn another_model(j: &Value, n_embd: usize) -> Option<String> {
    let eps = j["layer_norm_epsilon"].as_f64().map(|e| e as f32);
    let inner = 4 * n_embd;
    let n_inner = j["n_inner"].as_u64() == Some(inner as u64);
    let wants = [
        (
            "layer_norm_epsilon",
            "1e-5".into(),
            eps == Some(super::LN_EPS),
        ),
        ("n_inner", format!("null or {inner} (4 x n_embd)"), n_inner),
        (
            "tie_word_embeddings",
            "true".into(),
            j["tie_word_embeddings"] == true,
        ),
        (
            "scale_attn_weights",
            "true".into(),
            j["scale_attn_weights"] == true,
        ),
        (
            "scale_attn_by_inverse_layer_idx",
            "false".into(),
            j["scale_attn_by_inverse_layer_idx"] == false,
        ),
    ];
    let (k, want, _) = wants
        .into_iter()
        .find(|(k, _, ok)| !ok && !j[*k].is_null())?;
    Some(format!(
        "{k} is {}: distgpt computes GPT-2 with {k} {want} only",
        j[k]
    ))
}

/// Model config and tokenizer from a Hugging Face GPT-2 `config.json`.
pub fn read_config(dir: &Path) -> Result<ModelMeta> {
    let (path, j) = read_hf_config(dir)?;
    let bad = |reason: String| Error::checkpoint(&path, reason);
    if j["model_type"].as_str().is_some_and(|t| t != "gpt2") {
        return Err(bad(format!(
            "model_type is {}, only gpt2 is supported",
            j["model_type"]
        )));
    }
    if !matches!(&j["activation_function"], Value::Null | Value::String(_))
        || j["activation_function"]
            .as_str()
            .is_some_and(|a| a != "gelu_new")
    {
        return Err(bad(format!(
            "activation_function {} is not supported (gelu_new only)",
            j["activation_function"]
        )));
    }
    let field = |k: &str| {
        j[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| bad(format!("missing or non-integer field '{k}'")))
    };
    let config = GptConfig {
        n_layer: field("n_layer")?,
        n_head: field("n_head")?,
        n_embd: field("n_embd")?,
        block_size: field("n_positions")?,
        vocab_size: field("vocab_size")?,
        blocks: Vec::new(),
    };
    config.validate()?;
    if let Some(why) = another_model(&j, config.n_embd) {
        return Err(bad(why));
    }
    let tokenizer = match j.get("distgpt_tokenizer") {
        Some(t) => match serde_json::from_value(t.clone()) {
            Ok(TokenizerSpec::Char { chars }) if chars.chars().count() != config.vocab_size => {
                return Err(bad(format!(
                    "distgpt_tokenizer has {} characters, and vocab_size is {}: each token is one character",
                    chars.chars().count(),
                    config.vocab_size
                )))
            }
            Ok(spec) => spec,
            Err(e) => return Err(bad(format!("invalid distgpt_tokenizer: {e}"))),
        },
        None if config.vocab_size == crate::model::gpt2::config::GPT2_VOCAB => TokenizerSpec::Gpt2,
        None => {
            return Err(bad(format!(
                "vocabulary of {} tokens is not GPT-2's and no tokenizer is recorded",
                config.vocab_size
            )))
        }
    };
    Ok(ModelMeta {
        config: config.into(),
        tokenizer,
        labels: Vec::new(),
    })
}

/// A Hugging Face GPT-2 folder: its config, tokenizer and whole parameters.
pub fn import(dir: &Path) -> Result<(ModelMeta, Vec<f32>)> {
    let meta = read_config(dir)?;
    let weights = dir.join(WEIGHTS_FILE);
    // every weight in 2 bytes at least (bf16 or f16), checked before the
    // model, or a layout of n_layer blocks, is made
    let c = &meta.config;
    let (e, l) = (c.n_embd() as u64, c.n_layer() as u64);
    let least = 2 * ((c.vocab_size() + c.block_size() + 2) as u64 * e + l * (12 * e + 13) * e);
    check_holds(
        &weights,
        least,
        &format!("the model config.json describes ({c})"),
    )?;
    // the hub's gpt2 names its tensors as GPT2Model does: `h.0...`, `wte.weight`
    let params = read_weights(c, &weights, None, Some("transformer."))?;
    Ok((meta, params))
}
