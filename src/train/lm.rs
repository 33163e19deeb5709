//! The language-model task (`train --task lm`, the default): a causal
//! language model of any registered family (GPT-2 from the command line) on
//! a text's or a shard directory's tokens, next-token loss, validation on
//! the first `eval_batches` windows of the val split, a sample from the
//! trained model where its family decodes, and a distgpt model directory
//! (`model.safetensors` under the layout's names, GPT-2's Hugging Face's;
//! checksummed `model.json`).

use super::task::{mean_loss, Eval, Task, TaskKind, TrainStream};
use super::TrainConfig;
use crate::backend::{Backend, WeightFormat};
use crate::checkpoint;
use crate::data::{Batch, DataLoader, Dataset, LoaderPosition, TokenizerSpec};
use crate::error::{Error, Result};
use crate::model::family::Generation;
use crate::model::files::ModelMeta;
use crate::model::ModelConfig;
use crate::parallel::Strategy;
use crate::sample::SampleConfig;
use std::path::Path;

/// A causal language model and its data.
pub struct LmTask<'a> {
    pub model: ModelConfig,
    pub data: &'a Dataset,
}

/// The validation split's loader at `cfg`'s batch shape, in order (the
/// same batches at every evaluation).
pub(super) fn val_loader<'a>(data: &'a Dataset, cfg: &TrainConfig) -> Result<DataLoader<'a>> {
    DataLoader::new(
        &data.val,
        "val",
        cfg.batch_size,
        cfg.seq_len,
        cfg.seed,
        false,
    )
}

impl TrainStream for DataLoader<'_> {
    fn batches_per_epoch(&self) -> usize {
        DataLoader::batches_per_epoch(self)
    }
    fn position(&self) -> LoaderPosition {
        self.position
    }
    fn seek(&mut self, position: LoaderPosition) {
        DataLoader::seek(self, position)
    }
    fn next_batch(&mut self, _step: usize) -> Batch {
        DataLoader::next_batch(self)
    }
}

impl<B: Backend> Task<B> for LmTask<'_> {
    fn kind(&self) -> TaskKind {
        TaskKind::Lm
    }

    fn model(&self) -> ModelConfig {
        self.model.clone()
    }

    fn data_name(&self) -> String {
        self.data.name.clone()
    }

    fn data_summary(&self) -> String {
        let ds = self.data;
        format!(
            "{} ({} train / {} val tokens)",
            ds.name,
            ds.train.len(),
            ds.val.len()
        )
    }

    fn tokenizer(&self) -> TokenizerSpec {
        self.data.tokenizer.spec()
    }

    fn fingerprint(&self) -> &str {
        self.data.fingerprint()
    }

    fn initial_params(&self, cfg: &TrainConfig, _backend: &B) -> Result<Vec<f32>> {
        match &cfg.init_from {
            Some(dir) => {
                let (meta, params) = checkpoint::read_model(dir)?;
                if meta.config != self.model {
                    return Err(Error::Config(format!(
                        "{} holds a model of {}, not the {} being trained",
                        dir.display(),
                        meta.config,
                        self.model
                    )));
                }
                Ok(params)
            }
            None => Ok(self.model.init_full(cfg.seed)),
        }
    }

    fn train_stream(&self, cfg: &TrainConfig) -> Result<Box<dyn TrainStream + '_>> {
        let (b, t) = (cfg.batch_size, cfg.seq_len);
        Ok(Box::new(DataLoader::new(
            &self.data.train,
            "train",
            b,
            t,
            cfg.seed,
            true,
        )?))
    }

    fn check_eval(&self, cfg: &TrainConfig) -> Result<()> {
        val_loader(self.data, cfg).map(drop)
    }

    fn evaluate(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Eval> {
        let mut val = val_loader(self.data, cfg)?;
        let n = cfg.eval_batches.clamp(1, val.batches_per_epoch());
        let batches = std::iter::from_fn(|| Some(val.next_batch()));
        let loss = mean_loss(batches, n, |b| strategy.eval_loss(b))?;
        Ok(Eval {
            loss,
            examples: n * cfg.batch_size,
            ..Eval::default()
        })
    }

    /// The family's model files (none for a family that writes none).
    fn save_model(&self, _backend: B, params: &[f32], dir: &Path) -> Result<()> {
        match self.model.registration().model_files {
            Some(files) => {
                let meta = ModelMeta {
                    config: self.model.clone(),
                    tokenizer: self.data.tokenizer.spec(),
                    labels: Vec::new(),
                };
                (files.write)(&meta, params, None, dir)
            }
            None => Ok(()),
        }
    }

    fn model_files(&self) -> &'static str {
        self.model
            .registration()
            .model_files
            .map_or("no model files (its family writes none)", |f| f.what)
    }

    /// Empty for a family that does not decode.
    fn sample(&self, backend: B, params: &[f32], tokens: usize, seed: u64) -> Result<String> {
        let tk = &self.data.tokenizer;
        let prompt = tk.no_prompt();
        let sc = SampleConfig {
            max_new_tokens: tokens,
            temperature: 0.8,
            top_k: 40,
            top_p: 1.0,
            seed,
        };
        let run = Generation {
            params,
            prompts: &[prompt],
            sample: &sc,
            stop: tk.eot(),
            format: WeightFormat::F32,
            tp: None,
            on_token: &mut |_, _| {},
        };
        let out = self.model.generate(backend, run)?;
        Ok(out.map_or(String::new(), |out| tk.decode(&out[0])))
    }
}
