//! The language-model task (`train --task lm`, the default): a GPT-2 on a
//! text's or a shard directory's tokens, next-token loss, validation on the
//! first `eval_batches` windows of the val split, a sample from the
//! trained model, and a distgpt model directory (`model.safetensors` with
//! Hugging Face GPT-2 names, checksummed `model.json`).

use super::task::{mean_loss, Eval, Task, TaskKind, TrainStream};
use super::TrainConfig;
use crate::backend::Backend;
use crate::checkpoint;
use crate::data::{Batch, DataLoader, Dataset, LoaderPosition, TokenizerSpec};
use crate::error::{Error, Result};
use crate::infer::generate::{generate, SampleConfig};
use crate::model::gpt2::init_full;
use crate::model::{Gpt2, GptConfig, ModelConfig};
use crate::parallel::Strategy;
use std::path::Path;

/// A GPT-2 and its data.
pub struct LmTask<'a> {
    pub model: GptConfig,
    pub data: &'a Dataset,
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
        self.model.clone().into()
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

    fn initial_params(&self, cfg: &TrainConfig, backend: &B) -> Result<Vec<f32>> {
        match &cfg.init_from {
            Some(dir) => {
                let (m, _) = checkpoint::load_model(backend.clone_fresh(), dir)?;
                if m.config != self.model {
                    return Err(Error::Config(format!(
                        "{} holds a model of {}, not the {} being trained",
                        dir.display(),
                        m.config,
                        self.model
                    )));
                }
                m.params_host()
            }
            None => Ok(init_full(&self.model, cfg.seed)),
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

    fn tokens(&self, batch: &Batch) -> usize {
        batch.inputs.len()
    }

    fn evaluate(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Eval> {
        let mut val = DataLoader::new(
            &self.data.val,
            "val",
            cfg.batch_size,
            cfg.seq_len,
            cfg.seed,
            false,
        )?;
        let n = cfg.eval_batches.clamp(1, val.batches_per_epoch());
        let batches = std::iter::from_fn(|| Some(val.next_batch()));
        let loss = mean_loss(batches, n, |b| strategy.eval_loss(b))?;
        Ok(Eval {
            loss,
            examples: n * cfg.batch_size,
            ..Eval::default()
        })
    }

    fn save_model(&self, backend: B, params: &[f32], dir: &Path) -> Result<()> {
        let mut model = Gpt2::new(backend, self.model.clone())?;
        model.set_params(params)?;
        checkpoint::save_model(&model, self.data.tokenizer.spec(), dir)
    }

    fn model_files(&self) -> &'static str {
        "model.safetensors, model.json"
    }

    fn sample(&self, backend: B, params: &[f32], tokens: usize, seed: u64) -> Result<String> {
        let mut model = Gpt2::new(backend, self.model.clone())?;
        model.set_params(params)?;
        let tk = &self.data.tokenizer;
        let prompt = match tk.eot() {
            Some(eot) => vec![eot],
            None => tk.encode("\n").unwrap_or_else(|_| vec![0]),
        };
        let sc = SampleConfig {
            max_new_tokens: tokens,
            temperature: 0.8,
            top_k: 40,
            top_p: 1.0,
            seed,
        };
        let out = generate(&model, &[prompt], &sc, tk.eot(), |_, _| {})?;
        Ok(tk.decode(&out[0]))
    }
}
