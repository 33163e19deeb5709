//! A GPT-2's model folder bound to its engine, for the tests: the library
//! reads and writes any family's folder (`checkpoint::read_model`,
//! `model::files::write_model`) as a config and its weights.

use distgpt::backend::Backend;
use distgpt::checkpoint::read_model;
use distgpt::data::TokenizerSpec;
use distgpt::error::{Error, Result};
use distgpt::model::files::{write_model, ModelMeta};
use distgpt::model::Gpt2;
use std::path::Path;

/// A GPT-2 from what `read_model` reads; another family is named.
#[allow(dead_code)] // not every includer reads a model
pub fn load_model<B: Backend>(backend: B, dir: &Path) -> Result<(Gpt2<B>, ModelMeta)> {
    let (meta, params) = read_model(dir)?;
    let Some(gpt2) = meta.config.gpt2() else {
        let (config, family) = (&meta.config, meta.config.family());
        let reason = format!("holds a {family} model ({config}): this reads GPT-2 models");
        return Err(Error::checkpoint(dir, reason));
    };
    let model = Gpt2::with_params(backend, gpt2.clone(), &params)?;
    Ok((model, meta))
}

/// `write_model` of a GPT-2.
#[allow(dead_code)] // not every includer writes a model
pub fn save_model<B: Backend>(model: &Gpt2<B>, tokenizer: TokenizerSpec, dir: &Path) -> Result<()> {
    let params = model.params_host()?;
    write_model(&model.config.clone().into(), &params, tokenizer, dir, false)
}
