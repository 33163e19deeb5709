//! Model weights on disk: safetensors under the Hugging Face GPT-2 names and
//! layouts, with `model.json` (config + tokenizer) beside them.

pub mod hf;
pub mod state;

use crate::backend::Backend;
use crate::data::TokenizerSpec;
use crate::error::{Error, Result};
use crate::model::{Gpt2, GptConfig};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const META_FILE: &str = "model.json";

/// What `model.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelMeta {
    pub config: GptConfig,
    pub tokenizer: TokenizerSpec,
}

/// Writes `bytes` to `path` atomically: temporary file, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| Error::io(path, e))
}

/// Serialises named f32 tensors (name, shape, values) to safetensors bytes;
/// `path` only names the file in errors.
fn f32_safetensors(tensors: &[(String, Vec<usize>, &[f32])], path: &Path) -> Result<Vec<u8>> {
    let bad = |e: safetensors::SafeTensorError| Error::Checkpoint {
        path: path.into(),
        reason: e.to_string(),
    };
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, x)| x.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(bad)?;
    safetensors::serialize(views, &None).map_err(bad)
}

/// Saves the weights as Hugging Face GPT-2 safetensors (the padded vocabulary rows are dropped).
pub fn save_weights<B: Backend>(model: &Gpt2<B>, path: &Path) -> Result<()> {
    let v = model.config.vocab_size;
    let tensors: Vec<(String, Vec<usize>, &[f32])> = model
        .layout
        .tensors
        .iter()
        .map(|t| {
            let mut shape = t.shape.clone();
            let mut r = t.range();
            if r == model.layout.wte() {
                shape[0] = v;
                r.end = r.start + v * shape[1];
            }
            (t.name.clone(), shape, &model.params[r])
        })
        .collect();
    let bytes = f32_safetensors(&tensors, path)?;
    write_atomic(path, &bytes)
}

/// Loads every tensor of the model's layout from a safetensors file with
/// Hugging Face GPT-2 names; extra tensors (e.g. `lm_head.weight`) are ignored.
pub fn load_weights<B: Backend>(model: &mut Gpt2<B>, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let bad = |reason: String| Error::Checkpoint {
        path: path.into(),
        reason,
    };
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let Gpt2 { engine, params, .. } = model;
    let v = engine.config.vocab_size;
    let wte = engine.layout.wte();
    for t in &engine.layout.tensors {
        let mut shape = t.shape.clone();
        let mut r = t.range();
        if r == wte {
            shape[0] = v;
            r.end = r.start + v * shape[1];
        }
        let view = st
            .tensor(&t.name)
            .map_err(|_| bad(format!("missing tensor '{}'", t.name)))?;
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor '{}' has dtype {:?}, expected F32",
                t.name,
                view.dtype()
            )));
        }
        if view.shape() != shape.as_slice() {
            return Err(bad(format!(
                "tensor '{}' has shape {:?}, expected {:?}",
                t.name,
                view.shape(),
                shape
            )));
        }
        for (d, chunk) in params[r].iter_mut().zip(view.data().chunks_exact(4)) {
            *d = f32::from_le_bytes(chunk.try_into().expect("4 bytes"));
        }
    }
    params[wte.start + v * engine.config.n_embd..wte.end].fill(0.0);
    Ok(())
}

/// Saves weights and `model.json` into a directory.
pub fn save_model<B: Backend>(model: &Gpt2<B>, tokenizer: TokenizerSpec, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    save_weights(model, &dir.join(WEIGHTS_FILE))?;
    let meta = ModelMeta {
        config: model.config.clone(),
        tokenizer,
    };
    let json = serde_json::to_string_pretty(&meta).expect("meta serialises");
    write_atomic(&dir.join(META_FILE), json.as_bytes())
}

/// Reads `model.json` from a directory.
pub fn read_meta(dir: &Path) -> Result<ModelMeta> {
    let path = dir.join(META_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path,
        reason: format!("invalid model metadata: {e}"),
    })
}

/// Config and tokenizer of a distgpt model directory or a Hugging Face folder.
pub fn read_any_meta(dir: &Path) -> Result<ModelMeta> {
    if dir.join(META_FILE).exists() || !dir.join(hf::CONFIG_FILE).exists() {
        read_meta(dir)
    } else {
        hf::read_config(dir)
    }
}

/// Builds a model from a directory written by [`save_model`] or from a
/// Hugging Face GPT-2 folder (`config.json` + `model.safetensors`).
pub fn load_model<B: Backend>(backend: B, dir: &Path) -> Result<(Gpt2<B>, ModelMeta)> {
    let meta = read_any_meta(dir)?;
    let mut model = Gpt2::new(backend, meta.config.clone())?;
    load_weights(&mut model, &dir.join(WEIGHTS_FILE))?;
    Ok((model, meta))
}
