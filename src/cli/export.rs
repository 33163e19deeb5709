//! `export`: a Hugging Face folder of a run, checkpoint or model folder.

use super::*;

#[derive(Args)]
pub(super) struct ExportArgs {
    /// A run directory (or any folder `generate` accepts).
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output folder for `GPT2LMHeadModel.from_pretrained`.
    #[arg(long)]
    out: PathBuf,
}

/// `export`: a Hugging Face folder of a run, checkpoint or model folder.
pub(super) fn run_export(a: ExportArgs) -> Result<()> {
    if train::classify::is_bert_folder(&a.run) {
        // a BERT run is a Hugging Face folder already: checked, then written anew
        use distgpt::model::bert::hf;
        let (model, params) = hf::load_folder(&a.run, None, 0)?;
        let vocab = a.run.join("vocab.txt");
        let vocab = vocab.exists().then_some(vocab.as_path());
        hf::write_folder(&model, &params, vocab, &a.out)?;
        distgpt::outln!(
            "wrote {} (a Hugging Face {model} folder: config.json, model.safetensors{})",
            a.out.display(),
            if vocab.is_some() { ", vocab.txt" } else { "" }
        );
        return Ok(());
    }
    let (model, meta) = checkpoint::load_model(Cpu::new(), &a.run)?;
    checkpoint::hf::export(&model, &meta.tokenizer, &a.out)?;
    distgpt::outln!("wrote {} (config.json, model.safetensors)", a.out.display());
    Ok(())
}
