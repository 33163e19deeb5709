//! Fine-tuning an encoder as a sequence classifier (`distgpt train --task
//! classify`): a Hugging Face BERT folder's weights under a fresh
//! classifier, a labelled set (`data::labelled`), any strategy, on thread
//! ranks or under mpirun, on any device. Each epoch reports the training loss, and the validation loss,
//! accuracy and F1; the end reports the test split's, and writes the
//! fine-tuned model as a Hugging Face folder with `classify.json` (every
//! epoch's figures) beside it.

use super::schedule::LrSchedule;
use crate::backend::Backend;
use crate::comm::Comm;
use crate::data::labelled::{Labelled, LabelledSet};
use crate::data::wordpiece::WordPiece;
use crate::data::IGNORE;
use crate::error::{Error, Result};
use crate::metrics;
use crate::model::bert::{hf, BertHead};
use crate::model::AdamWConfig;
use crate::parallel::{self, launch, ParallelConfig, StepConfig, Strategy};
use indicatif::ProgressBar;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What `train --task classify` was asked for.
#[derive(Clone, Debug)]
pub struct ClassifyConfig {
    /// A Hugging Face BERT folder (config.json, model.safetensors, vocab.txt).
    pub init_from: PathBuf,
    /// A labelled set directory (train/val/test.jsonl, labels.json).
    pub data: PathBuf,
    pub epochs: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub lr: f32,
    /// Warmup as a share of all steps (then a cosine decay to lr / 10).
    pub warmup: f32,
    pub adamw: AdamWConfig,
    pub grad_clip: f32,
    pub seed: u64,
    /// Fine-tune on N training examples only (a sample drawn with the seed).
    pub train_examples: Option<usize>,
    /// Where the fine-tuned folder and `classify.json` go (none: not written).
    pub out_dir: Option<PathBuf>,
    /// Rank 0's bar (its length is set to the steps); none draws nothing.
    pub progress: Option<ProgressBar>,
}

/// Accuracy and F1 of predictions against labels (F1 of label 1 for two
/// labels, the mean over labels otherwise).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Scores {
    pub loss: f32,
    pub accuracy: f64,
    pub f1: f64,
    pub examples: usize,
}

impl Scores {
    /// From (predicted, true) label pairs.
    pub fn of(pairs: &[(u32, u32)], labels: usize, loss: f32) -> Self {
        let n = pairs.len();
        let right = pairs.iter().filter(|(p, t)| p == t).count();
        let f1_of = |k: u32| {
            let tp = pairs.iter().filter(|&&(p, t)| p == k && t == k).count() as f64;
            let fp = pairs.iter().filter(|&&(p, t)| p == k && t != k).count() as f64;
            let fneg = pairs.iter().filter(|&&(p, t)| p != k && t == k).count() as f64;
            if tp == 0.0 {
                0.0
            } else {
                2.0 * tp / (2.0 * tp + fp + fneg)
            }
        };
        let f1 = match labels {
            2 => f1_of(1),
            _ => (0..labels as u32).map(f1_of).sum::<f64>() / labels as f64,
        };
        Scores {
            loss,
            accuracy: right as f64 / n.max(1) as f64,
            f1,
            examples: n,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct EpochRecord {
    pub epoch: usize,
    pub train_loss: f32,
    pub val: Scores,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ClassifySummary {
    pub model: String,
    pub labels: Vec<String>,
    pub layout: String,
    pub epochs: Vec<EpochRecord>,
    pub test: Scores,
    pub seconds: f64,
    /// The training loss of every optimizer step.
    pub losses: Vec<f32>,
    /// Mean optimizer step time after the first (which allocates).
    pub step_ms: f64,
    /// Every rank's peak bytes: [params, grads, optimizer, activations, other, total].
    pub rank_peak_bytes: Vec<[u64; 6]>,
}

/// Loss and scores of a split, every rank taking part (collective).
pub fn score(
    strategy: &mut dyn Strategy,
    split: &Labelled,
    wp: &WordPiece,
    (b, t, labels): (usize, usize, usize),
) -> Result<Scores> {
    let mut pairs = Vec::with_capacity(split.examples.len());
    let (mut loss_sum, mut terms) = (0.0f64, 0usize);
    for batch in split.batches(wp, b, t, None) {
        let n = batch.loss_terms();
        let (loss, logits) = strategy.eval_outputs(&batch)?;
        loss_sum += loss as f64 * n as f64;
        terms += n;
        for (row, &target) in logits.chunks(labels).zip(&batch.targets) {
            if target != IGNORE {
                let best = (0..labels)
                    .max_by(|&i, &j| row[i].total_cmp(&row[j]))
                    .expect("at least two labels") as u32;
                pairs.push((best, target));
            }
        }
    }
    Ok(Scores::of(
        &pairs,
        labels,
        (loss_sum / terms.max(1) as f64) as f32,
    ))
}

/// Whether `dir` is a Hugging Face BERT folder (its config says so).
pub fn is_bert_folder(dir: &std::path::Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|j| j["model_type"].as_str() == Some("bert"))
}

/// A classifier folder's scores on a labelled set's test split (one rank
/// on `backend`, `threads` threads).
pub fn evaluate_folder<B: Backend + 'static>(
    backend: B,
    dir: &std::path::Path,
    data: &std::path::Path,
    (b, t): (usize, usize),
    threads: usize,
) -> Result<Scores> {
    let set = LabelledSet::load(data)?;
    let wp = WordPiece::from_vocab_file(&dir.join("vocab.txt"))?;
    let labels = set.labels.len();
    let (model, params) = hf::load_folder(dir, None, 0)?;
    if model.head != (BertHead::Classify { labels }) {
        return Err(Error::Input(format!(
            "{} is not a {labels}-way classifier ({model}) but {} names {labels} labels",
            dir.display(),
            data.display()
        )));
    }
    let par = ParallelConfig {
        strategy: parallel::StrategyKind::Single,
        world_size: 1,
        tp: 1,
        recompute: false,
        precision: Default::default(),
    };
    let out = launch::run_local(1, threads, Duration::from_secs(600), |world| {
        let mut s = parallel::build(
            backend.for_rank(world.as_ref())?,
            model.clone(),
            par,
            world.as_ref(),
            AdamWConfig::default(),
            b,
            t,
        )?;
        s.load_full(&params)?;
        score(s.as_mut(), &set.test, &wp, (b, t, labels))
    })?;
    Ok(out[0])
}

/// Everything a rank needs to fine-tune, read once (every rank reads the
/// same files, so every rank holds the same).
pub struct ClassifyJob {
    cfg: ClassifyConfig,
    set: LabelledSet,
    wp: WordPiece,
    model: crate::model::bert::BertConfig,
    init: Vec<f32>,
    sched: LrSchedule,
    steps: usize,
}

impl ClassifyJob {
    /// The model being fine-tuned (the folder's encoder, a classifier head).
    pub fn model(&self) -> crate::model::ModelConfig {
        self.model.clone().into()
    }

    /// Reads the labelled set, the vocabulary and the weights; checks them.
    pub fn new(cfg: &ClassifyConfig) -> Result<Self> {
        if cfg.epochs == 0 || cfg.batch_size == 0 || cfg.seq_len < 2 {
            return Err(Error::Config(
                "--epochs and --batch-size must be at least 1 and --seq-len at least 2".into(),
            ));
        }
        let mut set = LabelledSet::load(&cfg.data)?;
        if let Some(n) = cfg.train_examples {
            if n == 0 {
                return Err(Error::Config("--train-examples must be at least 1".into()));
            }
            set.train.sample(n, cfg.seed);
        }
        let vocab = cfg.init_from.join("vocab.txt");
        let wp = WordPiece::from_vocab_file(&vocab)?;
        let head = BertHead::Classify {
            labels: set.labels.len(),
        };
        let (model, init) = hf::load_folder(&cfg.init_from, Some(head), cfg.seed)?;
        if wp.vocab_size() != model.vocab_size {
            return Err(Error::Input(format!(
                "{} has {} tokens but the model's vocabulary is {}",
                vocab.display(),
                wp.vocab_size(),
                model.vocab_size
            )));
        }
        if cfg.seq_len > model.block_size {
            return Err(Error::Config(format!(
                "--seq-len {} is more than the model's {} positions",
                cfg.seq_len, model.block_size
            )));
        }
        let steps = set.train.examples.len().div_ceil(cfg.batch_size) * cfg.epochs;
        let sched = LrSchedule {
            max_lr: cfg.lr,
            min_lr: cfg.lr / 10.0,
            warmup_steps: ((steps as f32 * cfg.warmup) as usize).max(1),
            total_steps: steps,
        };
        Ok(ClassifyJob {
            cfg: cfg.clone(),
            set,
            wp,
            model,
            init,
            sched,
            steps,
        })
    }
}

/// One rank's fine-tuning (collective); rank 0 writes the model folder and
/// `classify.json` and returns the summary. A signal (`INTERRUPTED`) stops
/// every rank after the current step, returning none.
pub fn classify_rank<B: Backend + 'static>(
    backend: B,
    job: &ClassifyJob,
    par: ParallelConfig,
    world: &dyn Comm,
) -> Result<Option<ClassifySummary>> {
    let ClassifyJob {
        cfg,
        set,
        wp,
        model,
        ..
    } = job;
    let (b, t, labels) = (cfg.batch_size, cfg.seq_len, set.labels.len());
    let lead = world.rank() == 0;
    let started = Instant::now();
    let mut s = parallel::build(backend, model.clone(), par, world, cfg.adamw, b, t)?;
    s.load_full(&job.init)?;
    let pb = match (&cfg.progress, lead) {
        (Some(bar), true) => {
            bar.set_length(job.steps as u64);
            bar.clone()
        }
        _ => ProgressBar::hidden(),
    };
    let mut epochs = Vec::new();
    let (mut losses, mut later_steps_s) = (Vec::with_capacity(job.steps), 0.0);
    let mut step = 0;
    for epoch in 0..cfg.epochs {
        let t0 = Instant::now();
        let (mut loss_sum, mut real_tokens) = (0.0f64, 0usize);
        let batches = set.train.batches(wp, b, t, Some(cfg.seed + epoch as u64));
        for batch in &batches {
            let lr = job.sched.at(step);
            let step_cfg = StepConfig {
                lr,
                grad_clip: cfg.grad_clip,
            };
            let t_step = Instant::now();
            let st = s.step(std::slice::from_ref(batch), step_cfg)?;
            if step > 0 {
                later_steps_s += t_step.elapsed().as_secs_f64();
            }
            losses.push(st.loss);
            // a signal (only `compare` installs a handler) ends the run on every rank
            let mut stop = [u32::from(super::INTERRUPTED.load(Ordering::SeqCst))];
            world.all_reduce(&mut stop)?;
            if stop[0] != 0 {
                pb.finish_and_clear();
                return Ok(None);
            }
            loss_sum += st.loss as f64;
            real_tokens += batch.lens.iter().map(|&l| l as usize).sum::<usize>();
            step += 1;
            pb.set_message(format!("epoch {} | loss {:.4}", epoch + 1, st.loss));
            pb.inc(1);
        }
        let seconds = t0.elapsed().as_secs_f64();
        let val = score(s.as_mut(), &set.val, wp, (b, t, labels))?;
        let rec = EpochRecord {
            epoch: epoch + 1,
            train_loss: (loss_sum / batches.len() as f64) as f32,
            val,
            seconds,
            tokens_per_s: real_tokens as f64 / seconds,
        };
        if lead {
            metrics::say(
                &pb,
                &format!(
                    "epoch {}: train loss {:.4} | val loss {:.4}, accuracy {:.2}%, F1 {:.4} | {:.0} s, {:.0} tokens/s",
                    rec.epoch,
                    rec.train_loss,
                    val.loss,
                    100.0 * val.accuracy,
                    val.f1,
                    seconds,
                    rec.tokens_per_s
                ),
            );
        }
        epochs.push(rec);
    }
    pb.finish_and_clear();
    let test = score(s.as_mut(), &set.test, wp, (b, t, labels))?;
    let full = s.full_params()?;
    let mut peaks = vec![0u64; 6 * world.size()];
    world.all_gather(&s.memory().peak_row(), &mut peaks)?;
    if !lead {
        return Ok(None);
    }
    let summary = ClassifySummary {
        model: model.to_string(),
        labels: set.labels.clone(),
        layout: format!("{} x{}", par.strategy, par.world_size),
        epochs,
        test,
        seconds: started.elapsed().as_secs_f64(),
        step_ms: 1e3 * later_steps_s / step.saturating_sub(1).max(1) as f64,
        losses,
        rank_peak_bytes: peaks
            .chunks(6)
            .map(|c| c.try_into().expect("rows of 6"))
            .collect(),
    };
    if let Some(dir) = &cfg.out_dir {
        let vocab = cfg.init_from.join("vocab.txt");
        hf::write_folder(model, &full, Some(&vocab), dir)?;
        let json = serde_json::to_string_pretty(&summary).expect("a summary serialises");
        std::fs::write(dir.join("classify.json"), json)
            .map_err(|e| Error::Input(format!("cannot write classify.json: {e}")))?;
    }
    Ok(Some(summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f1_is_the_positive_labels_for_two_labels_and_the_mean_otherwise() {
        // tp 2, fp 1, fn 1 for label 1: F1 = 4 / 6
        let pairs = [(1, 1), (1, 1), (1, 0), (0, 1), (0, 0)];
        let s = Scores::of(&pairs, 2, 0.5);
        assert!((s.accuracy - 0.6).abs() < 1e-12 && (s.f1 - 4.0 / 6.0).abs() < 1e-12);
        let s = Scores::of(&[(0, 0), (1, 1), (2, 1)], 3, 0.0);
        // label 0: 1; label 1: 2/3; label 2: 0
        assert!((s.f1 - (1.0 + 2.0 / 3.0) / 3.0).abs() < 1e-12);
    }
}
