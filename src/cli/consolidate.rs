//! `checkpoint consolidate`: a checkpoint's model as its family's model files.

use super::*;
use distgpt::model::files::ModelMeta;

#[derive(Args)]
pub(super) struct ConsolidateArgs {
    /// A run directory (its newest checkpoint) or one checkpoint directory.
    #[arg(value_name = "RUN")]
    checkpoint: PathBuf,
    /// Output directory (created; one that already holds files is refused unless --overwrite).
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it is the input or already holds files.
    #[arg(long)]
    overwrite: bool,
}

/// Writes a checkpoint's model as a model directory (weights, then model.json).
/// A BERT's folder gets `vocab` (its `vocab.txt`) when given, else the one
/// the checkpoint keeps.
pub(super) fn consolidate(
    checkpoint_dir: &Path,
    out: &Path,
    vocab: Option<&Path>,
) -> Result<checkpoint::state::Index> {
    let kept = checkpoint_dir.join("vocab.txt");
    let vocab = vocab.or(kept.exists().then_some(kept.as_path()));
    if out.extension().is_some_and(|e| e == "safetensors") {
        bail!(
            "--out {} names a file: give a directory (model.safetensors and model.json are written into it)",
            out.display()
        );
    }
    let state = checkpoint::state::load(checkpoint_dir)?;
    let model = &state.index.model;
    let Some(files) = model.registration().model_files else {
        bail!("the {} family writes no model files", model.family());
    };
    let meta = ModelMeta {
        config: model.clone(),
        tokenizer: state.index.tokenizer.clone(),
        labels: state.index.labels.clone(),
    };
    (files.write)(&meta, &state.params, vocab, out)?;
    Ok(state.index)
}

/// `checkpoint consolidate`: a checkpoint's model as model files.
pub(super) fn run_consolidate(a: ConsolidateArgs) -> Result<()> {
    if a.out.extension().is_some_and(|e| e == "safetensors") {
        return weights_file(a);
    }
    refuse_output_over_input(&a.checkpoint, &a.out, a.overwrite)?;
    let dir = checkpoint::state::latest(&a.checkpoint).context("nothing to consolidate")?;
    let index = consolidate(&dir, &a.out, None)?;
    distgpt::outln!(
        "wrote {} ({}) from {} (step {}, saved by {} on {})",
        a.out.display(),
        index
            .model
            .registration()
            .model_files
            .map_or("", |f| f.what),
        dir.display(),
        index.step,
        index.strategy,
        distgpt::metrics::count(index.world_size, "rank")
    );
    Ok(())
}

/// `--out FILE.safetensors`, the first release's form (one weights file
/// where a folder is written now): the folder's `model.safetensors` alone,
/// at FILE.
fn weights_file(a: ConsolidateArgs) -> Result<()> {
    old_spelling(
        "checkpoint consolidate RUN --out FILE.safetensors",
        "checkpoint consolidate RUN --out DIR (DIR/model.safetensors)",
    );
    if a.out.is_dir() || (a.out.exists() && !a.overwrite) {
        bail!(
            "--out {} exists; pass --overwrite to replace a file",
            a.out.display()
        );
    }
    let dir = checkpoint::state::latest(&a.checkpoint).context("nothing to consolidate")?;
    // a folder of this process's own beside the file, gone after
    let folder = a
        .out
        .with_extension(format!("safetensors.{}", std::process::id()));
    let weights = folder.join(distgpt::model::files::WEIGHTS_FILE);
    let written = consolidate(&dir, &folder, None).and_then(|index| {
        std::fs::rename(&weights, &a.out).map_err(|e| distgpt::error::Error::io(&weights, e))?;
        Ok(index)
    });
    let _ = std::fs::remove_dir_all(&folder);
    let index = written?;
    distgpt::outln!(
        "wrote {} from {} (step {})",
        a.out.display(),
        dir.display(),
        index.step
    );
    Ok(())
}
