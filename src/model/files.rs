//! Model weights on disk, for any family: safetensors under the layout's
//! tensor names (GPT-2's are Hugging Face's) in the family's file shapes,
//! with `model.json` (config + tokenizer) beside them, or a Hugging Face
//! folder its family reads. `model.json` records the checksum of the
//! weights file and of itself, so a flipped bit or an edited shape is
//! refused on load, as are non-finite weights.

use crate::data::TokenizerSpec;
use crate::error::{Error, Result};
use crate::model::{ModelConfig, ParamLayout};
use crate::store::{self, widen_into, write_safetensors, Data};
use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const META_FILE: &str = "model.json";
/// A Hugging Face folder's config.
pub const HF_CONFIG: &str = "config.json";
/// The files of a model folder (a GPT-2's `model.json`, or a BERT's or a
/// Hugging Face folder's `config.json`), weights last.
pub const MODEL_FILES: [&str; 3] = [META_FILE, HF_CONFIG, WEIGHTS_FILE];

/// A Hugging Face folder's `config.json`, parsed, and its path (for errors).
pub fn read_hf_config(dir: &Path) -> Result<(std::path::PathBuf, serde_json::Value)> {
    let path = dir.join(HF_CONFIG);
    let text = store::read_text(&path)?;
    match serde_json::from_str(&text) {
        Ok(json) => Ok((path, json)),
        Err(e) => Err(Error::checkpoint(&path, format!("invalid JSON: {e}"))),
    }
}

/// A model's shape (of any family), tokenizer, and the names of its output
/// labels where it is a classifier that knows them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelMeta {
    pub config: ModelConfig,
    pub tokenizer: TokenizerSpec,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
}

/// What `model.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct MetaFile {
    #[serde(flatten)]
    meta: ModelMeta,
    /// The block matrices are stored in int8 (written by `distgpt quantize`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    int8: bool,
    /// [`store::checksum`] of `model.safetensors`.
    weights_checksum: String,
    /// [`store::json_checksum`] of this file with this field empty
    /// (checked by [`store::stored_checksum`]).
    checksum: String,
}

impl MetaFile {
    fn compute_checksum(&self) -> String {
        store::json_checksum(&MetaFile {
            checksum: String::new(),
            ..self.clone()
        })
    }
}

/// The int8 scales' tensor beside block matrix `name`.
fn scale_name(name: &str) -> String {
    format!("{name}_scale")
}

/// Each tensor of `layout` as the model files store it: its name, its
/// family's file shape (GPT-2's word embeddings without their padding
/// rows, which are the trailing ones) and that many elements from its start.
fn stored(
    config: &ModelConfig,
    layout: &ParamLayout,
) -> Vec<(String, Vec<usize>, std::ops::Range<usize>)> {
    layout
        .tensors
        .iter()
        .map(|t| {
            let shape = config.file_shape(t);
            let start = t.range().start;
            let len: usize = shape.iter().product();
            (t.name.clone(), shape, start..start + len)
        })
        .collect()
}

/// Writes `params` (the whole model) as safetensors at `path`, the tensors
/// the family stores in int8 so when `int8` (symmetric per output column,
/// each with an F32 `<name>_scale`); returns the file's checksum.
pub fn write_weights(
    config: &ModelConfig,
    params: &[f32],
    path: &Path,
    int8: bool,
) -> Result<String> {
    let layout = config.layout(1);
    let mut tensors = Vec::new();
    for (t, (name, shape, r)) in layout.tensors.iter().zip(stored(config, &layout)) {
        let w = &params[r];
        if int8 && config.block_matrix(t) {
            let (codes, scales) =
                crate::backend::cpu::int8::quantize_columns(w, shape[0], shape[1]);
            let bytes = codes.iter().map(|&c| c as u8).collect();
            let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
            tensors.push((
                scale_name(&name),
                Dtype::F32,
                vec![shape[1]],
                Data::Bytes(scale_bytes),
            ));
            tensors.push((name, Dtype::I8, shape, Data::Bytes(bytes)));
        } else {
            tensors.push((name, Dtype::F32, shape, Data::F32(w)));
        }
    }
    write_safetensors(path, &tensors)
}

/// A tensor name with each run of digits made `#`: the kind of tensor,
/// whichever block it belongs to.
fn kind_of(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c.is_ascii_digit() {
            true if out.ends_with('#') => {}
            true => out.push('#'),
            false => out.push(c),
        }
    }
    out
}

/// Reads every tensor of `config`'s layout from a safetensors file under
/// the layout's names; extra tensors of other kinds (e.g. `lm_head.weight`)
/// are ignored, but one of a kind the layout has under another number (a
/// block past the config's `n_layer`) is an error: the config and the
/// weights disagree. With `expected_checksum` the file must match it;
/// every weight must be finite. With `base`, a layout name's prefix, the
/// file may name its tensors without it, as a base model's file does
/// (`transformers`' `base_model_prefix`: the hub's `gpt2` and
/// `GPT2Model.save_pretrained` write `wte.weight` for
/// `transformer.wte.weight`). The whole model's parameters, padding rows
/// zero.
pub fn read_weights(
    config: &ModelConfig,
    path: &Path,
    expected_checksum: Option<&str>,
    base: Option<&str>,
) -> Result<Vec<f32>> {
    // mapped, not read: the weights are copied once, into their places, and
    // a model's worth of fresh pages is not zeroed first for the file
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only; a weights file changed underneath a
    // load is the user's to avoid, as with any memory-mapped input.
    let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let bad = |reason: String| Error::checkpoint(path, reason);
    if let Some(want) = expected_checksum {
        let sum = store::checksum(&bytes);
        if sum != want {
            return Err(bad(format!(
                "checksum {sum} does not match {want} recorded in {META_FILE}: the weights are corrupted or were replaced"
            )));
        }
    }
    let st = store::read_safetensors(&bytes)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let layout = config.layout(1);
    // a file's name as the layout's
    let full = |n: &str| match base {
        Some(b) if !n.starts_with(b) => format!("{b}{n}"),
        _ => n.to_string(),
    };
    let names = layout.tensors.iter().map(|t| t.name.clone());
    if let Some(reason) = no_place(names, &st, full, config.n_layer()) {
        return Err(bad(reason));
    }
    let mut params = vec![0.0f32; layout.total()];
    for (t, (name, shape, r)) in layout.tensors.iter().zip(stored(config, &layout)) {
        let short = base.and_then(|b| name.strip_prefix(b));
        let view = st
            .tensor(&name)
            .or_else(|e| short.map_or(Err(e), |s| st.tensor(s)))
            .map_err(|_| bad(format!("missing tensor '{name}'")))?;
        if view.shape() != shape.as_slice() {
            return Err(bad(format!(
                "tensor '{name}' has shape {:?}, expected {shape:?}",
                view.shape(),
            )));
        }
        let out = &mut params[r.clone()];
        match view.dtype() {
            Dtype::I8 if config.block_matrix(t) => {
                dequantize(&st, &name, view.data(), shape[1], out).map_err(bad)?
            }
            other if !widen_into(other, view.data(), out) => {
                return Err(bad(format!(
                    "tensor '{name}' has dtype {other:?}, expected F32, BF16 or F16"
                )))
            }
            _ => {}
        }
        if let Some(i) = params[r].iter().position(|x| !x.is_finite()) {
            return Err(bad(format!(
                "tensor '{name}' holds a non-finite weight at element {i}"
            )));
        }
    }
    Ok(params)
}

/// Why weights file `st` holds a tensor of a kind the model has (a block's
/// weight, say) that has no place in the model its config describes, if it
/// does: the config and the weights disagree. `names` are the model's
/// tensors as a file names them; `canonical` maps those and the file's
/// names alike (a prefix a file may leave off, an old spelling).
pub(crate) fn no_place(
    names: impl IntoIterator<Item = String>,
    st: &SafeTensors,
    canonical: impl Fn(&str) -> String,
    n_layer: usize,
) -> Option<String> {
    let names: std::collections::HashSet<String> =
        names.into_iter().map(|n| canonical(&n)).collect();
    let kinds: std::collections::HashSet<String> = names.iter().map(|n| kind_of(n)).collect();
    let mut extra: Vec<&String> = st
        .names()
        .into_iter()
        .filter(|n| {
            let c = canonical(n);
            !names.contains(&c) && kinds.contains(&kind_of(&c))
        })
        .collect();
    extra.sort();
    let first = extra.first()?;
    Some(format!(
        "tensor '{first}' ({} such) has no place in the model its config describes ({}): the config and the weights disagree",
        extra.len(),
        crate::metrics::count(n_layer, "layer")
    ))
}

/// Int8 `codes` of block matrix `name` (`cols` columns), times their
/// column's scale (the file's tensor `scale_name(name)`), into `out`.
fn dequantize(
    st: &SafeTensors,
    name: &str,
    codes: &[u8],
    cols: usize,
    out: &mut [f32],
) -> std::result::Result<(), String> {
    let scale = scale_name(name);
    let scales = st
        .tensor(&scale)
        .map_err(|_| format!("int8 tensor '{name}' has no '{scale}'"))?;
    if scales.dtype() != Dtype::F32 || scales.shape() != [cols] {
        return Err(format!(
            "'{scale}' must be F32 of shape [{cols}], not {:?} {:?}",
            scales.dtype(),
            scales.shape()
        ));
    }
    let scales: Vec<f32> = scales
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    for (e, (d, &code)) in out.iter_mut().zip(codes).enumerate() {
        *d = code as i8 as f32 * scales[e % cols];
    }
    Ok(())
}

/// Saves weights and then `model.json` (which vouches for them) into a
/// directory, each atomically: an interrupted save leaves a `model.json`
/// that refuses the new weights, never one that accepts wrong ones. With
/// `int8` the tensors the family marks are stored in int8 (the codes and
/// scales `--weights int8` decodes with); loading gives them dequantized.
pub fn write_model(
    config: &ModelConfig,
    params: &[f32],
    tokenizer: TokenizerSpec,
    dir: &Path,
    int8: bool,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let weights_checksum = write_weights(config, params, &dir.join(WEIGHTS_FILE), int8)?;
    let mut file = MetaFile {
        meta: ModelMeta {
            config: config.clone(),
            tokenizer,
            labels: Vec::new(),
        },
        int8,
        weights_checksum,
        checksum: String::new(),
    };
    file.checksum = file.compute_checksum();
    store::write_json(&dir.join(META_FILE), &file).map(drop)
}

/// Reads and verifies `model.json`; returns it with the weights' checksum
/// and whether they are stored in int8.
fn read_meta_file(dir: &Path) -> Result<(ModelMeta, String, bool)> {
    let path = dir.join(META_FILE);
    let text = store::read_text(&path)?;
    let bad = |reason: String| Error::checkpoint(&path, reason);
    let (sum, recorded) =
        store::stored_checksum(&text).map_err(|e| bad(format!("invalid model metadata: {e}")))?;
    if sum != recorded {
        return Err(bad(format!(
            "checksum {sum} does not match the recorded {recorded}: the file was edited or corrupted"
        )));
    }
    let file: MetaFile =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid model metadata: {e}")))?;
    file.meta
        .config
        .validate()
        .map_err(|e| bad(e.to_string()))?;
    Ok((file.meta, file.weights_checksum, file.int8))
}

/// Config and tokenizer of model files: `model.json`, or a Hugging Face
/// folder's config as its family reads it.
pub fn read_files_meta(dir: &Path) -> Result<ModelMeta> {
    if is_hf_folder(dir) {
        return hf_import(dir).map(|(meta, _)| meta);
    }
    read_meta_file(dir).map(|(meta, ..)| meta)
}

/// Whether `dir` is a Hugging Face folder rather than a distgpt model directory.
fn is_hf_folder(dir: &Path) -> bool {
    !dir.join(META_FILE).exists() && dir.join(HF_CONFIG).exists()
}

/// Checks the model files in `dir` are `model`'s and readable: checksums
/// that match, every weight finite (what a resume repairs when not).
pub fn verify_model_files(dir: &Path, model: &crate::model::ModelConfig) -> Result<()> {
    let bad = |found: String| {
        Error::checkpoint(
            dir,
            format!("holds a model of {found}, not the run's {model}"),
        )
    };
    let files = model.registration().model_files.ok_or_else(|| {
        Error::checkpoint(
            dir,
            format!("the {} family writes no model files", model.family()),
        )
    })?;
    let found = (files.read)(dir)?;
    if &found != model {
        return Err(bad(found.to_string()));
    }
    Ok(())
}

/// A Hugging Face folder, read by the family whose `model_type` it names.
fn hf_import(dir: &Path) -> Result<(ModelMeta, Vec<f32>)> {
    let family = crate::model::family::hf_family(dir)?;
    let hf = family.hf.expect("hf_family finds families with a folder");
    (hf.import)(dir)
}

/// Refuses weights file `path` when shorter than the `need` bytes of
/// `model`'s weights: checked before the model is allocated, so a config
/// asking for more than the file holds is an error, not an abort.
pub fn check_holds(path: &Path, need: u64, model: &str) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::checkpoint(path, "is a folder, not a weights file"));
    }
    let have = meta.len();
    if have < need {
        return Err(Error::checkpoint(path, format!("{have} bytes cannot hold the {need} bytes of weights of {model}: the file is truncated or the config is wrong")));
    }
    Ok(())
}

/// Refuses `model`, of `params` weights, where its fp32 weights alone pass
/// the memory available now: they are allocated before a weight is read
/// (a head a file lacks is drawn fresh), so a config asking for more is an
/// error, not an abort.
pub fn check_fits(params: usize, model: &str) -> std::result::Result<(), String> {
    let need = params as u64 * 4;
    match crate::metrics::available_memory_bytes() {
        Some(free) if need > free => Err(format!(
            "{model} has {} parameters, {} in fp32, more than the {} of memory available: the config is wrong or the model is too large for this machine",
            params,
            crate::metrics::human_bytes(need),
            crate::metrics::human_bytes(free)
        )),
        _ => Ok(()),
    }
}

/// `checkpoint::read_model` from model files only (`model.json` + `model.safetensors`,
/// or a Hugging Face folder), never from a checkpoint.
pub fn read_model_files(dir: &Path) -> Result<(ModelMeta, Vec<f32>)> {
    if is_hf_folder(dir) {
        return hf_import(dir);
    }
    let (meta, checksum, int8) = read_meta_file(dir)?;
    let weights = dir.join(WEIGHTS_FILE);
    // A config asking for more than the file holds is refused before allocating it.
    let c = &meta.config;
    let layout = c.layout(1);
    let stored: usize = layout
        .tensors
        .iter()
        .map(|t| c.file_shape(t).iter().product::<usize>())
        .sum();
    // int8 files hold at least a byte per weight.
    let need = if int8 { stored } else { 4 * stored } as u64;
    let model = format!("a {} x {} model", c.n_layer(), c.n_embd());
    check_holds(&weights, need, &model)?;
    let params = read_weights(c, &weights, Some(&checksum), None)?;
    Ok((meta, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    #[test]
    fn tensors_the_model_has_no_kind_of_are_read_past_a_block_too_many_is_refused_and_bf16_widens()
    {
        let cfg: ModelConfig = GptConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            block_size: 8,
            vocab_size: 16,
            blocks: Vec::new(),
        }
        .into();
        let layout = cfg.layout(1);
        let params: Vec<f32> = (0..layout.total()).map(|i| i as f32 * 1e-3).collect();
        let f32s = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let model: Vec<_> = stored(&cfg, &layout)
            .into_iter()
            .map(|(name, shape, r)| (name, Dtype::F32, shape, f32s(&params[r])))
            .collect();
        let dir = crate::testdir::TestDir::new("extra-tensors");
        let read = |tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]| {
            let path = dir.path().join("model.safetensors");
            let data: Vec<_> = tensors
                .iter()
                .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), Data::Bytes(b.clone())))
                .collect();
            write_safetensors(&path, &data).unwrap();
            read_weights(&cfg, &path, None, None)
        };
        let plain = read(&model).unwrap();
        // the same weights saved in bf16 read as their values rounded
        let rounded = |x: f32| half::bf16::from_f32(x);
        let halves: Vec<_> = stored(&cfg, &layout)
            .into_iter()
            .map(|(name, shape, r)| {
                let bytes = params[r].iter().flat_map(|&x| rounded(x).to_le_bytes());
                (name, Dtype::BF16, shape, bytes.collect())
            })
            .collect();
        let want: Vec<f32> = plain.iter().map(|&x| rounded(x).to_f32()).collect();
        assert_eq!(read(&halves).unwrap(), want);
        assert_ne!(want, plain);
        // an older Hugging Face file's causal-mask buffer: no kind of ours
        let mut with_mask = model.clone();
        let mask = (
            "transformer.h.0.attn.bias".to_string(),
            Dtype::F32,
            vec![1],
            f32s(&[1.0]),
        );
        with_mask.push(mask);
        assert_eq!(read(&with_mask).unwrap(), plain);
        // int8 only for a block's matrices: a norm's weight so is refused
        let mut int8_norm = model.clone();
        let ln = int8_norm
            .iter_mut()
            .find(|t| t.0 == "transformer.h.0.ln_1.weight")
            .unwrap();
        (ln.1, ln.3) = (Dtype::I8, vec![1; 8]);
        let e = read(&int8_norm).unwrap_err().to_string();
        assert!(
            e.contains("tensor 'transformer.h.0.ln_1.weight' has dtype I8, expected F32"),
            "{e}"
        );
        // a second block's norm, where the config has one block
        let mut two = model;
        let norm = (
            "transformer.h.1.ln_1.weight".to_string(),
            Dtype::F32,
            vec![8],
            f32s(&[1.0; 8]),
        );
        two.push(norm);
        let e = read(&two).unwrap_err().to_string();
        assert!(
            e.contains("tensor 'transformer.h.1.ln_1.weight' (1 such) has no place"),
            "{e}"
        );
    }
}
