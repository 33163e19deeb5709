//! `export`: a Hugging Face folder of a run, checkpoint or model folder.

use super::*;

#[derive(Args)]
pub(super) struct ExportArgs {
    /// A run directory (or any folder `generate` accepts).
    #[arg(value_name = "RUN", required_unless_present = "old_run")]
    run: Option<PathBuf>,
    /// `--run RUN`: RUN's spelling before it was positional.
    #[arg(long = "run", value_name = "RUN", hide = true, conflicts_with = "run")]
    old_run: Option<PathBuf>,
    /// Output folder for `transformers`' `from_pretrained` (GPT2LMHeadModel,
    /// or a BERT's class).
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it is the input or already holds files.
    #[arg(long)]
    overwrite: bool,
}

/// `export`: a Hugging Face folder of a run, checkpoint or model folder,
/// as the model's family writes one.
pub(super) fn run_export(a: ExportArgs) -> Result<()> {
    let run = run_or_old_flag("export", a.run, a.old_run);
    refuse_output_over_input(&run, &a.out, a.overwrite)?;
    let (meta, params) = checkpoint::read_model(&run)?;
    let model = &meta.config;
    let Some(hf) = model.registration().hf else {
        bail!(
            "the {} family has no Hugging Face folder to export",
            model.family()
        );
    };
    // a BERT's vocabulary goes along where the run or checkpoint keeps it
    let vocab = checkpoint::model_dir(&run).join("vocab.txt");
    let vocab = vocab.exists().then_some(vocab.as_path());
    (hf.export)(&meta, &params, vocab, &a.out)?;
    let mut files: Vec<String> = std::fs::read_dir(&a.out)
        .map_err(|e| anyhow::anyhow!("cannot list {}: {e}", a.out.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    files.sort();
    distgpt::outln!(
        "wrote {} (a Hugging Face {} folder: {})",
        a.out.display(),
        model.family(),
        files.join(", ")
    );
    Ok(())
}
