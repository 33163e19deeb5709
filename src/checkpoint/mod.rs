//! Reading a model from whatever holds one (model files, a Hugging Face
//! folder, a training-state checkpoint) and the training state itself
//! ([`state`]): above `parallel`, whose sharded state it saves.

pub mod state;

use crate::error::{Error, Result};
use crate::model::files::{
    read_files_meta, read_model_files, ModelMeta, HF_CONFIG, META_FILE, WEIGHTS_FILE,
};
use std::path::Path;

/// The training-state checkpoint to read a model from when `dir` has no
/// model files: `dir` itself (`RUN/checkpoints/step_N`), or the newest of a
/// run that is still training or was stopped before writing them. Model
/// files with one of the pair missing are a damaged model, refused.
fn checkpoint_instead(dir: &Path) -> Result<Option<std::path::PathBuf>> {
    let has = |file: &str| dir.join(file).exists();
    let (kept, gone) = match (has(META_FILE), has(WEIGHTS_FILE)) {
        (true, true) => return Ok(None),
        (false, _) if has(HF_CONFIG) => return Ok(None),
        (true, false) => (META_FILE, WEIGHTS_FILE.to_string()),
        (false, true) => (WEIGHTS_FILE, format!("{META_FILE} (nor a Hugging Face {HF_CONFIG})")),
        (false, false) => return state::latest(dir).map(Some).map_err(|_| Error::Input(format!(
            "{}: holds no model: neither distgpt's {META_FILE} and {WEIGHTS_FILE}, a Hugging Face {HF_CONFIG}, nor a checkpoint",
            dir.display()
        ))),
    };
    let again = match state::latest(dir) {
        Ok(_) => "`distgpt train --resume` writes a run's again; one of its checkpoints, checkpoints/step_N, can be read instead",
        // an export, a quantized or pruned copy cut short
        Err(_) => "the command that wrote them writes them again, with --overwrite",
    };
    let reason =
        format!("has {kept} but no {gone}: its model files are incomplete or damaged ({again})");
    Err(Error::checkpoint(dir, reason))
}

/// The folder [`read_model`] reads `dir`'s model from: `dir` itself, or
/// the training-state checkpoint it stands for (a `step_N` directory, or a
/// run's newest when the run has no model files yet). Files a task keeps
/// beside the model (a BERT's `vocab.txt`) are there.
pub fn model_dir(dir: &Path) -> std::path::PathBuf {
    checkpoint_instead(dir)
        .ok()
        .flatten()
        .unwrap_or_else(|| dir.to_path_buf())
}

/// Refuses a path that is no directory, in words (not as the OS error
/// about a file inside it); a missing checkpoint is told those its run
/// has (their names are `step_` and eight digits).
pub(crate) fn existing_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let what = if dir.exists() {
        "not a directory".to_string()
    } else {
        let parent =
            (dir.parent()).filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n == state::DIR));
        let mut there: Vec<String> = parent
            .and_then(|p| std::fs::read_dir(p).ok())
            .into_iter()
            .flatten()
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                let done = name.starts_with("step_") && !name.ends_with(".tmp");
                (e.path().is_dir() && done).then_some(name)
            })
            .collect();
        there.sort();
        match (parent, there.len()) {
            (Some(p), 1..=12) => format!(
                "no such checkpoint ({} holds {})",
                p.display(),
                there.join(", ")
            ),
            (Some(p), n @ 13..) => format!(
                "no such checkpoint ({} holds {n}, from {} to {})",
                p.display(),
                there[0],
                there[n - 1]
            ),
            _ => "no such directory".to_string(),
        }
    };
    Err(Error::Input(format!(
        "{}: {what}: give a run directory, a model folder or a checkpoint",
        dir.display()
    )))
}

/// Config and tokenizer of a distgpt model directory, a Hugging Face folder,
/// or a checkpoint (directory, or a run's newest).
pub fn read_any_meta(dir: &Path) -> Result<ModelMeta> {
    existing_dir(dir)?;
    if let Some(ckpt) = checkpoint_instead(dir)? {
        let index = state::read_index(&ckpt)?;
        return Ok(ModelMeta {
            config: index.model,
            tokenizer: index.tokenizer,
            labels: index.labels,
        });
    }
    read_files_meta(dir)
}

/// A model's description and whole parameters from a directory written by
/// [`write_model`](crate::model::files::write_model), a Hugging Face GPT-2 folder (`config.json` +
/// `model.safetensors`), or a training-state checkpoint (a `step_N`
/// directory, or a run's newest when it has no model files yet).
pub fn read_model(dir: &Path) -> Result<(ModelMeta, Vec<f32>)> {
    existing_dir(dir)?;
    if let Some(ckpt) = checkpoint_instead(dir)? {
        let loaded = state::load(&ckpt)?;
        let meta = ModelMeta {
            config: loaded.index.model,
            tokenizer: loaded.index.tokenizer,
            labels: loaded.index.labels,
        };
        return Ok((meta, loaded.params));
    }
    read_model_files(dir)
}
