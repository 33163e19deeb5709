//! What a task supplies to the one run driver ([`super::train_rank`]):
//! its model, its training batches (a stream that can seek to a saved
//! position), its evaluation and its output format. Everything else — the
//! schedule, checkpoints and resume, stop signals, run records, metrics,
//! the model files' checksums — is the driver's, the same for every task.
//!
//! A task is read once (its data, vocabulary and starting weights) and
//! shared by every thread rank; each rank draws its own [`TrainStream`].

use super::TrainConfig;
use crate::backend::Backend;
use crate::data::{Batch, LoaderPosition, TokenizerSpec};
use crate::error::Result;
use crate::metrics::StepRecord;
use crate::model::ModelConfig;
use crate::parallel::Strategy;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The tasks `train --task` offers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// A GPT-2 language model (next-token prediction).
    #[default]
    Lm,
    /// A BERT masked language model.
    Mlm,
    /// A BERT sequence classifier.
    Classify,
    /// A BERT pretrained as `BertForPreTraining`: masked-LM and
    /// next-sentence prediction on WordPiece tokens.
    Pretrain,
}

crate::display_as_flag!(TaskKind);

/// An evaluation's figures: the loss (a language model's next-token loss,
/// the masked-token loss, the classifier's, pretraining's masked-LM plus
/// next-sentence) and, for a classifier, its accuracy and F1 over
/// `examples` examples (for pretraining, the next-sentence head's).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Eval {
    pub loss: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f1: Option<f64>,
    #[serde(default)]
    pub examples: usize,
}

/// A rank's training batches: global micro-batches in a fixed order that
/// a saved [`LoaderPosition`] resumes exactly.
pub trait TrainStream {
    /// Micro-batches in one pass over the training split.
    fn batches_per_epoch(&self) -> usize;
    /// Where the next batch comes from.
    fn position(&self) -> LoaderPosition;
    /// Moves to a saved position.
    fn seek(&mut self, position: LoaderPosition);
    /// The next micro-batch of optimizer step `step` (0-based): tasks that
    /// draw randomness per batch (MLM's masks) draw it from the seed and
    /// the step, so a resumed run draws the same.
    fn next_batch(&mut self, step: usize) -> Batch;
}

/// Whole epochs a stream at `p` has finished.
pub fn epochs_done(p: LoaderPosition, batches_per_epoch: usize) -> u64 {
    p.epoch + u64::from(p.batch >= batches_per_epoch)
}

/// The part of a run that differs between tasks.
pub trait Task<B: Backend>: Sync {
    fn kind(&self) -> TaskKind;
    /// The model being trained.
    fn model(&self) -> ModelConfig;
    /// The data's name, for the header and `run.json`.
    fn data_name(&self) -> String;
    /// One line on the data for the header (splits and their sizes).
    fn data_summary(&self) -> String;
    /// What a checkpoint records to refuse resuming on other data: the
    /// tokenizer and the data's fingerprint.
    fn tokenizer(&self) -> TokenizerSpec;
    fn fingerprint(&self) -> &str;
    /// Whether `recorded`, a checkpoint's fingerprint of its data, is of
    /// this task's data: [`Task::fingerprint`], or what an older version
    /// recorded of the same data.
    fn trained_on(&self, recorded: &str) -> bool {
        recorded == self.fingerprint()
    }
    /// The whole model a new run starts from (a fresh initialisation by
    /// `cfg.seed`, or pretrained weights).
    fn initial_params(&self, cfg: &TrainConfig, backend: &B) -> Result<Vec<f32>>;
    /// This rank's training stream for `cfg`'s batch shape and seed.
    fn train_stream(&self, cfg: &TrainConfig) -> Result<Box<dyn TrainStream + '_>>;
    /// The tokens of a batch that count for throughput: every input
    /// token, unless the task says otherwise (a classifier's real tokens,
    /// padding left out).
    fn tokens(&self, batch: &Batch) -> usize {
        batch.inputs.len()
    }
    /// **Collective.** The validation split's figures.
    fn evaluate(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Eval>;
    /// Refuses a validation split that [`Task::evaluate`] could not read
    /// at `cfg`'s batch shape (every run evaluates at its last step), before
    /// a run directory is emptied or a step is trained.
    fn check_eval(&self, _cfg: &TrainConfig) -> Result<()> {
        Ok(())
    }
    /// **Collective.** The test split's figures at the end, for a task
    /// that has one.
    fn test(&self, _strategy: &mut dyn Strategy, _cfg: &TrainConfig) -> Result<Option<Eval>> {
        Ok(None)
    }
    /// Evaluate at every epoch's end besides every `eval_every` steps.
    fn evaluates_each_epoch(&self) -> bool {
        false
    }
    /// The vocabulary kept beside the model and in every checkpoint (a
    /// BERT's `vocab.txt`), so each can be evaluated, exported or
    /// fine-tuned alone; None where the model files record it.
    fn vocab(&self) -> Option<String> {
        None
    }
    /// The names of a classifier's labels in id order, recorded with the
    /// model (`id2label`) and in every checkpoint; none for other tasks.
    fn labels(&self) -> &[String] {
        &[]
    }
    /// Writes the trained model as the task's folder (atomic, checksummed).
    fn save_model(&self, backend: B, params: &[f32], dir: &Path) -> Result<()>;
    /// What the model folder is, for the closing lines.
    fn model_files(&self) -> &'static str;
    /// Writes what the task reports beside its model at a finished run's
    /// end, from the whole run's step records and the test split's figures.
    fn write_report(
        &self,
        _dir: &Path,
        _history: &[StepRecord],
        _test: Eval,
        _layout: &str,
    ) -> Result<()> {
        Ok(())
    }
    /// The file [`Task::write_report`] writes into the run directory, for a
    /// task that reports (a finished run without it was stopped while
    /// scoring its test split).
    fn report_file(&self) -> Option<&'static str> {
        None
    }
    /// A sample from the model, for a task that generates (empty otherwise).
    fn sample(&self, _backend: B, _params: &[f32], _tokens: usize, _seed: u64) -> Result<String> {
        Ok(String::new())
    }
}

/// The mean of `f` over the first `n` (at least 1, at most `batches`)
/// batches: a validation loss.
pub fn mean_loss(
    batches: impl Iterator<Item = Batch>,
    n: usize,
    mut f: impl FnMut(&Batch) -> Result<f32>,
) -> Result<f32> {
    let (mut sum, mut count) = (0.0f64, 0usize);
    for b in batches.take(n.max(1)) {
        sum += f(&b)? as f64;
        count += 1;
    }
    Ok((sum / count.max(1) as f64) as f32)
}
