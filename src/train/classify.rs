//! Fine-tuning an encoder as a sequence classifier (`distgpt train --task
//! classify`): a Hugging Face BERT folder's weights under a fresh
//! classifier, a labelled set (`data::labelled`), any strategy, on thread
//! ranks or under mpirun, on any device. Each epoch reports the training loss, and the validation loss,
//! accuracy and F1; the end reports the test split's, and writes the
//! fine-tuned model as a Hugging Face folder with `classify.json` (every
//! epoch's figures) beside it. A run with a directory writes training-state
//! checkpoints (`checkpoint::state`) at every epoch's end, every
//! `checkpoint_every` steps and when a signal stops it, each with the run's
//! settings and its epochs so far (`fine_tune.json`), and resumes from one
//! exactly: the epoch's shuffle comes from the seed and the epoch, the
//! batches already trained are skipped.

use super::schedule::LrSchedule;
use crate::backend::Backend;
use crate::checkpoint::state;
use crate::comm::Comm;
use crate::data::labelled::{Labelled, LabelledSet};
use crate::data::wordpiece::WordPiece;
use crate::data::LoaderPosition;
use crate::data::IGNORE;
use crate::error::{Error, Result};
use crate::metrics;
use crate::model::bert::{hf, BertHead};
use crate::model::AdamWConfig;
use crate::parallel::{self, launch, ParallelConfig, StepConfig, Strategy};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What `train --task classify` was asked for (its settings are recorded
/// in every checkpoint; where the run goes and how it keeps its work are not).
#[derive(Clone, Debug, Serialize, Deserialize)]
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
    /// The run directory: the fine-tuned folder, `classify.json` and the
    /// checkpoints (none: nothing is written).
    #[serde(skip)]
    pub out_dir: Option<PathBuf>,
    #[serde(skip)]
    pub keeping: Keeping,
    /// Rank 0's bar (its length is set to the steps); none draws nothing.
    #[serde(skip)]
    pub progress: Option<ProgressBar>,
}

/// How a fine-tuning run with a directory keeps its work.
#[derive(Clone, Debug, Default)]
pub struct Keeping {
    /// Empty a new run's directory that holds an earlier run.
    pub overwrite: bool,
    /// Steps between checkpoints besides each epoch's end (0: none).
    pub checkpoint_every: usize,
    pub keep_checkpoints: usize,
    /// A checkpoint directory to continue from.
    pub resume: Option<PathBuf>,
    /// Stop with a checkpoint after this many steps of this invocation.
    pub stop_after: Option<usize>,
}

/// The file a fine-tuning checkpoint holds beside its tensors.
pub const PROGRESS_FILE: &str = "fine_tune.json";

/// What a fine-tuning checkpoint records besides the tensors: the run's
/// settings and how far it got.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Progress {
    pub config: ClassifyConfig,
    /// The epochs completed.
    pub epochs: Vec<EpochRecord>,
    /// The current epoch so far: training-loss sum, real tokens, seconds.
    pub partial: (f64, usize, f64),
}

impl Progress {
    /// The record in checkpoint `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(PROGRESS_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::Checkpoint {
            path: dir.to_path_buf(),
            reason: format!(
                "cannot read {PROGRESS_FILE} ({e}): not a checkpoint of a fine-tuning run"
            ),
        })?;
        serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
            path,
            reason: format!("invalid record: {e}"),
        })
    }
}

/// How a fine-tuning run ended (rank 0's view).
pub enum Finished {
    Done(ClassifySummary),
    /// A signal or `stop_after` stopped it after `step`, with a checkpoint
    /// when it has a directory.
    Stopped {
        step: usize,
    },
}

/// Accuracy and F1 of predictions against labels (F1 of label 1 for two
/// labels, the mean over labels otherwise).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
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

#[derive(Clone, Debug, Serialize, Deserialize)]
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
        pipeline: Default::default(),
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
    fingerprint: String,
    resume: Option<(state::Loaded, Progress)>,
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
        let fingerprint = set.fingerprint();
        let resume = match &cfg.keeping.resume {
            None => None,
            Some(dir) => {
                let ckpt = state::load(dir)?;
                let bad = |reason: String| Error::Checkpoint {
                    path: dir.clone(),
                    reason,
                };
                let family = crate::model::ModelConfig::from(model.clone());
                if ckpt.index.model != family {
                    return Err(bad(format!(
                        "holds a {}, not the {family} being fine-tuned",
                        ckpt.index.model
                    )));
                }
                if ckpt.index.tokenizer != wp.spec() {
                    return Err(bad(format!(
                        "was trained with another vocabulary than {}",
                        vocab.display()
                    )));
                }
                if ckpt.index.data != fingerprint {
                    return Err(bad(format!(
                        "was trained on other examples than {} holds",
                        cfg.data.display()
                    )));
                }
                if ckpt.index.step >= steps {
                    return Err(bad(format!(
                        "is at step {}, not before the run's last ({steps}: raise --epochs to train on)",
                        ckpt.index.step
                    )));
                }
                let progress = Progress::read(dir)?;
                Some((ckpt, progress))
            }
        };
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
            fingerprint,
            resume,
        })
    }
}

/// One rank's fine-tuning (collective); rank 0 writes the model folder and
/// `classify.json` and returns how the run ended. A signal (`INTERRUPTED`)
/// or `stop_after` stops every rank after the same step, with a checkpoint
/// when the run has a directory.
pub fn classify_rank<B: Backend + 'static>(
    backend: B,
    job: &ClassifyJob,
    par: ParallelConfig,
    world: &dyn Comm,
) -> Result<Option<Finished>> {
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
    let (start, first_epoch, skip, mut epochs, partial) = match &job.resume {
        None => {
            s.load_full(&job.init)?;
            (0, 0, 0, Vec::new(), (0.0, 0, 0.0))
        }
        Some((ckpt, progress)) => {
            let i = &ckpt.index;
            s.load_state(&ckpt.params, &ckpt.m, &ckpt.v, i.adam_step)?;
            let (epoch, batch) = (i.loader.epoch as usize, i.loader.batch);
            (
                i.step,
                epoch,
                batch,
                progress.epochs.clone(),
                progress.partial,
            )
        }
    };
    let run = match &cfg.out_dir {
        Some(dir) => Some(super::ready_run_dir(
            world,
            dir,
            start,
            cfg.keeping.overwrite,
        )?),
        None => None,
    };
    let family = crate::model::ModelConfig::from(model.clone());
    let save = |s: &mut Box<dyn Strategy>,
                step: usize,
                loader: LoaderPosition,
                epochs: &[EpochRecord],
                partial: (f64, usize, f64)|
     -> Result<()> {
        let Some(dir) = &run else { return Ok(()) };
        let progress = Progress {
            config: cfg.clone(),
            epochs: epochs.to_vec(),
            partial,
        };
        let info = state::SaveInfo {
            step,
            adam_step: step as u32,
            loader,
            strategy: &par.strategy.to_string(),
            tp: par.resolved().tp,
            params_total: family.num_params(),
            model: &family,
            tokenizer: &wp.spec(),
            data: &job.fingerprint,
            keep: cfg.keeping.keep_checkpoints,
            extra: Some((
                PROGRESS_FILE,
                serde_json::to_string_pretty(&progress).expect("a record serialises"),
            )),
        };
        state::save(dir, &info, &s.owned_state()?, world).map(|_| ())
    };
    let pb = match (&cfg.progress, lead) {
        (Some(bar), true) => {
            bar.set_length(job.steps as u64);
            bar.set_position(start as u64);
            bar.clone()
        }
        _ => ProgressBar::hidden(),
    };
    let (mut losses, mut later_steps_s) = (Vec::with_capacity(job.steps - start), 0.0);
    let mut step = start;
    for epoch in first_epoch..cfg.epochs {
        let t0 = Instant::now();
        let resumed = epoch == first_epoch;
        let (mut loss_sum, mut real_tokens, earlier_s) = match resumed {
            true => partial,
            false => (0.0, 0, 0.0),
        };
        let batches = set.train.batches(wp, b, t, Some(cfg.seed + epoch as u64));
        let (mut stop, mut stopped_mid_epoch) = (false, false);
        for (i, batch) in batches
            .iter()
            .enumerate()
            .skip(if resumed { skip } else { 0 })
        {
            let lr = job.sched.at(step);
            let step_cfg = StepConfig {
                lr,
                grad_clip: cfg.grad_clip,
            };
            let t_step = Instant::now();
            let st = s.step(std::slice::from_ref(batch), step_cfg)?;
            if step > start {
                later_steps_s += t_step.elapsed().as_secs_f64();
            }
            losses.push(st.loss);
            loss_sum += st.loss as f64;
            real_tokens += batch.lens.iter().map(|&l| l as usize).sum::<usize>();
            step += 1;
            pb.set_message(format!("epoch {} | loss {:.4}", epoch + 1, st.loss));
            pb.inc(1);
            // a signal ends the run on every rank after the same step
            let mut flag = [u32::from(super::INTERRUPTED.load(Ordering::SeqCst))];
            world.all_reduce(&mut flag)?;
            stop = flag[0] != 0 || cfg.keeping.stop_after == Some(step - start);
            let every = cfg.keeping.checkpoint_every;
            // an epoch's last step is saved after its validation, below
            if i + 1 < batches.len() && (stop || (every > 0 && step.is_multiple_of(every))) {
                let so_far = (
                    loss_sum,
                    real_tokens,
                    earlier_s + t0.elapsed().as_secs_f64(),
                );
                let at = LoaderPosition {
                    epoch: epoch as u64,
                    batch: i + 1,
                };
                save(&mut s, step, at, &epochs, so_far)?;
            }
            if stop {
                stopped_mid_epoch = i + 1 < batches.len();
                break;
            }
        }
        if stopped_mid_epoch {
            pb.finish_and_clear();
            return Ok(lead.then_some(Finished::Stopped { step }));
        }
        let seconds = earlier_s + t0.elapsed().as_secs_f64();
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
        let next = LoaderPosition {
            epoch: epoch as u64 + 1,
            batch: 0,
        };
        save(&mut s, step, next, &epochs, (0.0, 0, 0.0))?;
        if stop && step < job.steps {
            pb.finish_and_clear();
            return Ok(lead.then_some(Finished::Stopped { step }));
        }
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
        step_ms: 1e3 * later_steps_s / (step - start).saturating_sub(1).max(1) as f64,
        losses,
        rank_peak_bytes: peaks
            .chunks(6)
            .map(|c| c.try_into().expect("rows of 6"))
            .collect(),
    };
    if let Some(dir) = &run {
        let vocab = cfg.init_from.join("vocab.txt");
        hf::write_folder(model, &full, Some(&vocab), dir)?;
        let json = serde_json::to_string_pretty(&summary).expect("a summary serialises");
        std::fs::write(dir.join("classify.json"), json)
            .map_err(|e| Error::Input(format!("cannot write classify.json: {e}")))?;
    }
    Ok(Some(Finished::Done(summary)))
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
