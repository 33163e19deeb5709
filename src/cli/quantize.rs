//! `quantize`: a GPT-2 with its block matrices in int8.

use super::*;

#[derive(Args)]
pub(super) struct QuantizeArgs {
    /// A run directory, one of its checkpoint directories, or a Hugging Face GPT-2 folder.
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output folder (model.safetensors and model.json).
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it is the input or already holds files.
    #[arg(long)]
    overwrite: bool,
}

/// `quantize`: the model with its block matrices in int8.
pub(super) fn run_quantize(a: QuantizeArgs) -> Result<()> {
    refuse_output_over_input(&a.run, &a.out, a.overwrite)?;
    let (meta, params) = checkpoint::read_model(&a.run)?;
    meta.config.check_quantizes()?;
    files::write_model(&meta.config, &params, meta.tokenizer, &a.out, true)?;
    let size = |d: &Path| std::fs::metadata(d.join(files::WEIGHTS_FILE)).map_or(0, |m| m.len());
    distgpt::outln!(
        "wrote {} (model.safetensors {}, block matrices in int8; fp32: {})",
        a.out.display(),
        metrics::human_bytes(size(&a.out)),
        metrics::human_bytes(4 * meta.config.num_params() as u64)
    );
    Ok(())
}
