//! Fine-tuning an encoder as a sequence classifier (`train --task
//! classify`): a Hugging Face BERT folder's weights under a fresh
//! classifier head, a labelled set (`data::labelled`: train/val/test.jsonl
//! and labels.json), each epoch's examples in an order drawn from the seed
//! and the epoch, padded to `seq_len`. Evaluation scores the whole
//! validation split (loss, accuracy, F1) every `eval_every` steps and at
//! every epoch's end; the test split is scored at the end. The fine-tuned
//! model is a Hugging Face `BertForSequenceClassification` folder with the
//! vocabulary, and `classify.json` holds every epoch's figures.

use super::task::{Eval, Task, TaskKind, TrainStream};
use super::TrainConfig;
use crate::backend::Backend;
use crate::data::labelled::{Labelled, LabelledSet};
use crate::data::wordpiece::WordPiece;
use crate::data::{Batch, LoaderPosition, TokenizerSpec, IGNORE};
use crate::error::{Error, Result};
use crate::metrics::StepRecord;
use crate::model::bert::{hf, BertConfig, BertHead};
use crate::model::ModelConfig;
use crate::parallel::Strategy;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The file beside a classifier's model with every epoch's figures.
pub const SUMMARY_FILE: &str = "classify.json";

/// A pretrained encoder, its vocabulary and a labelled set.
pub struct ClassifyTask {
    pub model: BertConfig,
    /// The pretrained weights under a fresh head (drawn from the seed).
    init: Vec<f32>,
    set: LabelledSet,
    wp: WordPiece,
    /// The folder's `vocab.txt`, copied into the model folder.
    vocab_file: PathBuf,
    data: PathBuf,
    fingerprint: String,
}

impl ClassifyTask {
    /// Reads the labelled set at `data` (its training split cut to
    /// `train_examples` drawn with `seed`), the vocabulary and the weights
    /// of the Hugging Face folder `init_from`; checks they fit `seq_len`.
    pub fn new(
        init_from: &Path,
        data: &Path,
        train_examples: Option<usize>,
        seq_len: usize,
        seed: u64,
    ) -> Result<Self> {
        let mut set = LabelledSet::load(data)?;
        if let Some(n) = train_examples {
            if n == 0 {
                return Err(Error::Config("--train-examples must be at least 1".into()));
            }
            let have = set.train.examples.len();
            if n > have {
                return Err(Error::Config(format!(
                    "--train-examples {n}: {} has {have} training examples",
                    data.display()
                )));
            }
            set.train.sample(n, seed);
        }
        let head = BertHead::Classify {
            labels: set.labels.len(),
        };
        let (model, init, wp, vocab_file) = pretrained_bert(init_from, head, seed, "classify")?;
        check_seq_len(seq_len, &model, set.has_pairs())?;
        let fingerprint = set.fingerprint();
        Ok(ClassifyTask {
            model,
            init,
            set,
            wp,
            vocab_file,
            data: data.to_path_buf(),
            fingerprint,
        })
    }

    /// A new run's start from `init_from`, its classifier drawn afresh from
    /// `seed` where `init_from` classifies other labels (their names or
    /// their order), said on stderr: its head would predict the old ids
    /// under the new names. A resumed run's checkpoint holds its own head.
    pub fn for_a_new_run(mut self, init_from: &Path, seed: u64) -> Self {
        let named = crate::checkpoint::read_any_meta(init_from).map_or(Vec::new(), |m| m.labels);
        if !named.is_empty() && named != self.set.labels {
            crate::model::bert::fresh_classifier(&self.model, &mut self.init, seed);
            crate::errln!(
                "note: {} classifies {named:?} and {} names {:?}: it starts with a fresh classifier",
                init_from.display(),
                self.data.display(),
                self.set.labels
            );
        }
        self
    }

    /// Batches of `b` in one pass over the training examples (the last
    /// one short, padded).
    pub fn batches_per_epoch(&self, b: usize) -> usize {
        self.set.train.examples.len().div_ceil(b.max(1))
    }

    /// A fine-tuning run's warmup unless one is asked for: a tenth of the
    /// steps `cfg` trains.
    pub fn default_warmup(&self, cfg: &TrainConfig) -> usize {
        let steps = cfg.duration.steps(
            self.batches_per_epoch(cfg.batch_size),
            cfg.grad_accum.max(1),
        );
        (steps / 10).max(1)
    }

    /// The folder's `vocab.txt`.
    pub fn vocab_file(&self) -> &Path {
        &self.vocab_file
    }

    /// The labelled set's directory.
    pub fn data_name(&self) -> String {
        self.data.display().to_string()
    }

    fn scores(&self, s: &mut dyn Strategy, split: &Labelled, cfg: &TrainConfig) -> Result<Eval> {
        let labels = self.set.labels.len();
        let sc = score(s, split, &self.wp, cfg.batch_size, cfg.seq_len, labels)?;
        Ok(Eval {
            loss: sc.loss,
            accuracy: Some(sc.accuracy),
            f1: Some(sc.f1),
            examples: sc.examples,
        })
    }
}

/// The sequence length a classifier of the BERT folder `dir` runs at
/// unless `--seq-len` says: [`DEFAULT_SEQ_LEN`], or the model's positions
/// where it has fewer (the default where the folder's config cannot be
/// read: loading it then says why).
pub fn default_seq_len(dir: &Path) -> usize {
    crate::checkpoint::read_any_meta(dir).map_or(DEFAULT_SEQ_LEN, |m| {
        m.config.block_size().min(DEFAULT_SEQ_LEN)
    })
}

/// A classifier's sequence length where its model has the positions.
pub const DEFAULT_SEQ_LEN: usize = 128;

/// Refuses a sequence length a classifier of `model` cannot take: at
/// least `[CLS]` and `[SEP]` (and a second `[SEP]` for a set of sentence
/// `pairs`), at most its positions.
fn check_seq_len(t: usize, model: &BertConfig, pairs: bool) -> Result<()> {
    let (least, what) = match pairs {
        true => (3, "[CLS] A [SEP] B [SEP] of a set of sentence pairs"),
        false => (2, "[CLS] and [SEP]"),
    };
    if t < least || t > model.block_size {
        return Err(Error::Config(format!(
            "--seq-len {t} must be between {least} ({what}) and the model's {} positions",
            model.block_size
        )));
    }
    Ok(())
}

/// An epoch's batches at a time, shuffled by the seed and the epoch, made
/// when its first batch is taken.
struct Epochs<'a> {
    task: &'a ClassifyTask,
    b: usize,
    t: usize,
    seed: u64,
    position: LoaderPosition,
    /// The batches of `position.epoch` (empty until taken from).
    batches: Vec<Batch>,
}

impl Epochs<'_> {
    fn load_epoch(&mut self) {
        let seed = self.seed.wrapping_add(self.position.epoch);
        self.batches = self
            .task
            .set
            .train
            .batches(&self.task.wp, self.b, self.t, Some(seed));
    }
}

impl TrainStream for Epochs<'_> {
    fn batches_per_epoch(&self) -> usize {
        self.task.batches_per_epoch(self.b)
    }
    fn position(&self) -> LoaderPosition {
        self.position
    }
    fn seek(&mut self, position: LoaderPosition) {
        self.position = position;
        self.batches.clear();
    }
    fn next_batch(&mut self, _step: usize) -> Batch {
        if self.position.batch >= self.batches_per_epoch() {
            self.position = LoaderPosition {
                epoch: self.position.epoch + 1,
                batch: 0,
            };
            self.batches.clear();
        }
        if self.batches.is_empty() {
            self.load_epoch();
        }
        self.position.batch += 1;
        self.batches[self.position.batch - 1].clone()
    }
}

impl<B: Backend> Task<B> for ClassifyTask {
    fn kind(&self) -> TaskKind {
        TaskKind::Classify
    }

    fn model(&self) -> ModelConfig {
        self.model.clone().into()
    }

    fn data_name(&self) -> String {
        ClassifyTask::data_name(self)
    }

    fn data_summary(&self) -> String {
        let s = &self.set;
        format!(
            "{} ({} labels; {} train / {} val / {} test examples)",
            self.data.display(),
            s.labels.len(),
            s.train.examples.len(),
            s.val.examples.len(),
            s.test.examples.len()
        )
    }

    fn tokenizer(&self) -> TokenizerSpec {
        self.wp.spec()
    }

    fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// A run before the set's fingerprint prefixed lengths recorded it
    /// otherwise; it is still resumed on its own set.
    fn trained_on(&self, recorded: &str) -> bool {
        recorded == self.fingerprint || recorded == self.set.fingerprint_before_lengths()
    }

    fn initial_params(&self, _cfg: &TrainConfig, _backend: &B) -> Result<Vec<f32>> {
        Ok(self.init.clone())
    }

    fn train_stream(&self, cfg: &TrainConfig) -> Result<Box<dyn TrainStream + '_>> {
        if self.set.train.examples.is_empty() {
            return Err(Error::Input(format!(
                "{} has no training examples",
                self.data.display()
            )));
        }
        Ok(Box::new(Epochs {
            task: self,
            b: cfg.batch_size,
            t: cfg.seq_len,
            seed: cfg.seed,
            position: LoaderPosition::default(),
            batches: Vec::new(),
        }))
    }

    /// The real tokens: an example's, without its padding; a filler row of
    /// a short last batch (its label ignored) has none.
    fn tokens(&self, batch: &Batch) -> usize {
        let rows = batch.lens.iter().zip(&batch.targets);
        rows.filter(|(_, &label)| label != IGNORE)
            .map(|(&l, _)| l as usize)
            .sum()
    }

    fn evaluate(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Eval> {
        self.scores(strategy, &self.set.val, cfg)
    }

    fn test(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Option<Eval>> {
        self.scores(strategy, &self.set.test, cfg).map(Some)
    }

    fn evaluates_each_epoch(&self) -> bool {
        true
    }

    fn vocab(&self) -> Option<String> {
        Some(self.wp.vocab_text())
    }

    fn labels(&self) -> &[String] {
        &self.set.labels
    }

    fn save_model(&self, _backend: B, params: &[f32], dir: &Path) -> Result<()> {
        hf::write_folder(&self.model, params, Some(&self.wp), &self.set.labels, dir)
    }

    fn write_report(
        &self,
        dir: &Path,
        history: &[StepRecord],
        test: Eval,
        layout: &str,
    ) -> Result<()> {
        let report = ClassifyReport {
            model: self.model.to_string(),
            labels: self.set.labels.clone(),
            layout: layout.to_string(),
            epochs: epoch_records(history),
            test: test.into(),
        };
        crate::store::write_json(&dir.join(SUMMARY_FILE), &report).map(drop)
    }

    fn report_file(&self) -> Option<&'static str> {
        Some(SUMMARY_FILE)
    }

    fn model_files(&self) -> &'static str {
        "a Hugging Face BertForSequenceClassification folder: config.json, model.safetensors, vocab.txt"
    }
}

/// Accuracy and F1 of predictions against labels (F1 of label 1 for two
/// labels, else the mean over the labels the true or the predicted ones
/// hold: sklearn's `f1_score`, binary or macro).
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
        let seen: Vec<u32> = (0..labels as u32)
            .filter(|&k| pairs.iter().any(|&(p, t)| p == k || t == k))
            .collect();
        let f1 = match labels {
            2 => f1_of(1),
            _ => seen.iter().map(|&k| f1_of(k)).sum::<f64>() / seen.len().max(1) as f64,
        };
        Scores {
            loss,
            accuracy: right as f64 / n.max(1) as f64,
            f1,
            examples: n,
        }
    }
}

/// Loss and scores of a split, every rank taking part (collective).
pub fn score(
    strategy: &mut dyn Strategy,
    split: &Labelled,
    wp: &WordPiece,
    b: usize,
    t: usize,
    labels: usize,
) -> Result<Scores> {
    let mut pairs = Vec::with_capacity(split.examples.len());
    let (mut loss_sum, mut terms) = (0.0f64, 0usize);
    for batch in split.batches(wp, b, t, None) {
        let n = batch.loss_terms().targets as usize;
        let (loss, logits) = strategy.eval_outputs(&batch)?;
        loss_sum += loss as f64 * n as f64;
        terms += n;
        pairs.extend(predicted(&logits, &batch.targets, labels));
    }
    Ok(Scores::of(
        &pairs,
        labels,
        (loss_sum / terms.max(1) as f64) as f32,
    ))
}

/// The (predicted, true) labels of the rows of a batch that have a target:
/// each row's highest of its `labels` logits.
pub fn predicted(logits: &[f32], targets: &[u32], labels: usize) -> Vec<(u32, u32)> {
    logits
        .chunks(labels)
        .zip(targets)
        .filter(|&(_, &target)| target != IGNORE)
        .map(|(row, &target)| {
            // the first of equal highest logits, as numpy's and torch's argmax
            let best = (1..labels).fold(0, |b, i| match row[i].total_cmp(&row[b]).is_gt() {
                true => i,
                false => b,
            });
            (best as u32, target)
        })
        .collect()
}

/// A BERT's weights to start training from, under `head` whatever head it
/// had (the tensors it lacks fresh from `seed`): a Hugging Face folder
/// (`config.json`, `model.safetensors`: all-MiniLM-L6-v2's, an export, a
/// finished BERT run), or a BERT run's training-state checkpoint (a
/// `step_N` directory, or a run's newest). `task` names the `--task`
/// asking, for the errors.
pub fn pretrained_weights(
    dir: &Path,
    head: BertHead,
    seed: u64,
    task: &str,
) -> Result<(BertConfig, Vec<f32>)> {
    let not_bert = |what: &str| {
        Error::Input(format!(
            "{} is {what}, and --task {task} trains a BERT: give --init-from a Hugging Face \
             BERT folder (config.json, model.safetensors, vocab.txt), a BERT run or one of \
             its checkpoints",
            dir.display()
        ))
    };
    if is_bert_folder(dir) {
        return hf::load_folder(dir, Some(head), seed);
    }
    if dir.join("config.json").exists() {
        return Err(not_bert("a Hugging Face folder of another family"));
    }
    let (meta, params) = crate::checkpoint::read_model(dir)?;
    let Some(bert) = meta.config.bert() else {
        return Err(not_bert(&format!("a {} model", meta.config.family())));
    };
    Ok(crate::model::bert::with_head(bert, &params, head, seed))
}

/// [`pretrained_weights`] with the WordPiece vocabulary they were trained
/// on and that vocabulary's file: a folder's `vocab.txt`, or the one a
/// checkpoint keeps and records.
pub fn pretrained_bert(
    dir: &Path,
    head: BertHead,
    seed: u64,
    task: &str,
) -> Result<(BertConfig, Vec<f32>, WordPiece, PathBuf)> {
    let (model, params) = pretrained_weights(dir, head, seed, task)?;
    let at = crate::checkpoint::model_dir(dir);
    let vocab_file = at.join("vocab.txt");
    let wp = if is_bert_folder(dir) {
        if !vocab_file.exists() {
            // a run of distgpt's own says what it tokenized with instead
            let used = crate::checkpoint::state::latest(dir)
                .and_then(|c| crate::checkpoint::state::read_index(&c))
                .map_or(String::new(), |i| {
                    format!(
                        " (it was trained on {})",
                        crate::data::describe(&i.tokenizer)
                    )
                });
            return Err(Error::Input(format!(
                "{} holds no vocab.txt{used}: a BERT to start from needs its WordPiece \
                 vocabulary; pretrain with --init-from a BERT folder, or on data prepared with \
                 --tokenizer wordpiece",
                dir.display()
            )));
        }
        hf::read_vocab(&at)?
    } else {
        match crate::checkpoint::read_any_meta(dir)?.tokenizer {
            spec @ TokenizerSpec::WordPiece { .. } => WordPiece::recorded_in(&at, &spec)?,
            other => {
                return Err(Error::Input(format!(
                    "{} was trained on {}, not a WordPiece vocabulary: a BERT to start from \
                     needs one (pretrain with --init-from a BERT folder, or on data prepared \
                     with --tokenizer wordpiece)",
                    dir.display(),
                    crate::data::describe(&other)
                )))
            }
        }
    };
    if wp.vocab_size() != model.vocab_size {
        return Err(Error::Input(format!(
            "{} has {} tokens but the model's vocabulary is {}",
            vocab_file.display(),
            wp.vocab_size(),
            model.vocab_size
        )));
    }
    Ok((model, params, wp, vocab_file))
}

/// Whether `dir` is a Hugging Face BERT folder (its config's `model_type`
/// names BERT's registration).
pub fn is_bert_folder(dir: &std::path::Path) -> bool {
    crate::model::family::hf_family(dir)
        .is_ok_and(|r| std::ptr::eq(r, &crate::model::bert::family::FAMILY))
}

/// A classifier folder's scores on a labelled set's test split (one rank
/// on `backend`, `threads` threads).
pub fn evaluate_folder<B: Backend + 'static>(
    backend: B,
    dir: &std::path::Path,
    data: &std::path::Path,
    b: usize,
    t: usize,
    threads: usize,
) -> Result<Scores> {
    let names = LabelledSet::load(data)?.labels;
    let labels = names.len();
    let meta = crate::checkpoint::read_any_meta(dir)?;
    if !meta.labels.is_empty() && meta.labels != names {
        return Err(Error::Input(format!(
            "{} was trained on the labels {:?} and {} names {:?}: its scores would count \
             a prediction right by id, whatever the names say (give it a set labelled as it was)",
            dir.display(),
            meta.labels,
            data.display(),
            names
        )));
    }
    let Some(found) = meta.config.bert() else {
        return Err(Error::Input(format!(
            "{} is a {}, not a BERT classifier",
            dir.display(),
            meta.config
        )));
    };
    if found.head != (BertHead::Classify { labels }) {
        return Err(Error::Input(format!(
            "{} is not a {labels}-way classifier ({found}) but {} names {labels} labels",
            dir.display(),
            data.display()
        )));
    }
    untrained(dir, Some(found.head))?;
    let task = ClassifyTask::new(dir, data, None, t, 0)?;
    let cfg = TrainConfig {
        batch_size: b,
        seq_len: t,
        ..TrainConfig::default()
    };
    super::evaluate_params(backend, &task, &task.init, &cfg, threads, true).map(Scores::from)
}

/// Refuses to evaluate a Hugging Face folder whose file lacks a part of its
/// head (or holds a classifier of another shape): reading it for training
/// starts that part from the seed, which `eval` would score as trained.
pub fn untrained(dir: &std::path::Path, head: Option<BertHead>) -> Result<()> {
    if !is_bert_folder(dir) {
        return Ok(());
    }
    match hf::untrained_head(dir, head)? {
        Some(name) => Err(Error::Input(format!(
            "{}: model.safetensors has no {name} (or one of another shape) for the model \
             config.json describes: its head was never trained, and a head drawn at random \
             would be scored as if it were; evaluate a folder trained with this head",
            dir.display()
        ))),
        None => Ok(()),
    }
}

/// One epoch of a classifier's run, from its step records.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EpochRecord {
    pub epoch: usize,
    /// The mean training loss of the epoch's steps.
    pub train_loss: f32,
    pub val: Scores,
    /// Seconds of optimizer steps (evaluation excluded).
    pub seconds: f64,
    /// Real (unpadded) tokens per second of those steps.
    pub tokens_per_s: f64,
}

/// The epochs a run's step records close (those evaluated at an epoch's
/// end): the steps since the previous one, the evaluation at its end. A
/// step closes an epoch when the epochs done rise in it, at its end or
/// within it (a step of several micro-batches can end in the next epoch).
pub fn epoch_records(history: &[StepRecord]) -> Vec<EpochRecord> {
    let mut out = Vec::new();
    let (mut loss, mut seconds, mut tokens, mut steps) = (0.0f64, 0.0f64, 0.0f64, 0usize);
    let mut before = 0.0;
    for r in history {
        loss += r.loss as f64;
        seconds += r.ms / 1e3;
        tokens += r.tokens_per_s * r.ms / 1e3;
        steps += 1;
        let whole = crate::metrics::whole_epochs(r.epoch);
        let at_end = whole > crate::metrics::whole_epochs(before);
        before = r.epoch;
        if let (true, Some(v), Some(accuracy), Some(f1)) =
            (at_end, r.val_loss, r.val_accuracy, r.val_f1)
        {
            out.push(EpochRecord {
                epoch: whole,
                train_loss: (loss / steps as f64) as f32,
                val: Scores {
                    loss: v,
                    accuracy,
                    f1,
                    examples: r.val_examples.unwrap_or(0),
                },
                seconds,
                tokens_per_s: tokens / seconds.max(1e-12),
            });
            (loss, seconds, tokens, steps) = (0.0, 0.0, 0.0, 0);
        }
    }
    out
}

/// `classify.json`: the labels, every epoch and the test split's scores.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClassifyReport {
    pub model: String,
    pub labels: Vec<String>,
    pub layout: String,
    pub epochs: Vec<EpochRecord>,
    pub test: Scores,
}

impl From<Eval> for Scores {
    fn from(e: Eval) -> Scores {
        Scores {
            loss: e.loss,
            accuracy: e.accuracy.unwrap_or(0.0),
            f1: e.f1.unwrap_or(0.0),
            examples: e.examples,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 batches an epoch, 2 a step (--grad-accum 2, --epochs 3): the
    /// loader ends its steps at 2/3, 4/3, 2, 8/3 and 10/3 epochs, and the
    /// run evaluates where an epoch ended, within the step or at its end:
    /// epochs 1, 2 and 3, each over the steps since the one before.
    #[test]
    fn a_step_that_ends_in_the_next_epoch_closes_the_one_before() {
        let val = |epoch: f64, loss: f32, at_end: bool| StepRecord {
            epoch,
            loss,
            ms: 1000.0,
            val_loss: at_end.then_some(0.5),
            val_accuracy: at_end.then_some(0.75),
            val_f1: at_end.then_some(0.5),
            ..Default::default()
        };
        let history = [
            val(2.0 / 3.0, 1.0, false),
            val(4.0 / 3.0, 3.0, true),
            val(2.0, 5.0, true),
            // an evaluation within the epoch (--eval-every) closes none
            val(8.0 / 3.0, 1.0, true),
            val(10.0 / 3.0, 2.0, true),
        ];
        let epochs = epoch_records(&history);
        let got: Vec<(usize, f32, f64)> = epochs
            .iter()
            .map(|e| (e.epoch, e.train_loss, e.seconds))
            .collect();
        assert_eq!(got, [(1, 2.0, 2.0), (2, 5.0, 1.0), (3, 1.5, 2.0)]);
    }

    #[test]
    fn a_sequence_length_is_from_cls_and_sep_to_the_models_positions() {
        let model = BertConfig::preset("bert-tiny").unwrap();
        let n = model.block_size;
        for ok in [2, 3, n - 1, n] {
            assert!(check_seq_len(ok, &model, false).is_ok(), "{ok}");
        }
        for bad in [0, 1, n + 1, 10 * n] {
            let e = check_seq_len(bad, &model, false).unwrap_err().to_string();
            assert!(
                e.contains(&format!("--seq-len {bad} must be between 2")),
                "{e}"
            );
        }
        // a pair needs a second [SEP]
        assert!(check_seq_len(3, &model, true).is_ok());
        let e = check_seq_len(2, &model, true).unwrap_err().to_string();
        assert!(e.contains("--seq-len 2 must be between 3"), "{e}");
    }

    /// A set of sentence pairs scored at 2 positions, which hold `[CLS]`
    /// and `[SEP]` but not the pair's second `[SEP]`, is refused in words
    /// (it once panicked on "capacity overflow" padding the rows).
    #[test]
    fn a_set_of_pairs_is_not_scored_at_fewer_positions_than_a_pair() {
        let tokens = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "is", "it", "yes", "no",
        ];
        let wp = WordPiece::new(tokens.map(String::from).to_vec()).unwrap();
        let dir = crate::testdir::TestDir::new("pairs-seq");
        let model = dir.path().join("model");
        hf::write_tiny(&wp, BertHead::Classify { labels: 2 }, &model);
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("labels.json"), r#"["no", "yes"]"#).unwrap();
        let pairs = "{\"label\": 1, \"text\": \"is it\", \"text_pair\": \"yes\"}\n\
                     {\"label\": 0, \"text\": \"is it\", \"text_pair\": \"no\"}\n";
        for split in ["train", "val", "test"] {
            std::fs::write(data.join(format!("{split}.jsonl")), pairs).unwrap();
        }
        let cpu = crate::backend::cpu::Cpu::new;
        let err = evaluate_folder(cpu(), &model, &data, 2, 2, 1)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("--seq-len 2 must be between 3"), "{err}");
        assert!(evaluate_folder(cpu(), &model, &data, 2, 3, 1).is_ok());
    }

    /// A run recorded its set's fingerprint before lengths were part of it
    /// (8c6c16355039b0ce: what `train --task classify` at 8feae7d wrote in
    /// its checkpoint's index.json for this fixture): it is still its data.
    #[test]
    fn a_fingerprint_recorded_before_lengths_is_still_the_sets() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference_runs/classify");
        let task =
            ClassifyTask::new(&fixture.join("init"), &fixture.join("data"), None, 12, 3).unwrap();
        let task: &dyn Task<crate::backend::cpu::Cpu> = &task;
        assert_ne!(task.fingerprint(), "8c6c16355039b0ce");
        assert!(task.trained_on("8c6c16355039b0ce"));
        assert!(task.trained_on(task.fingerprint()));
        assert!(!task.trained_on("8c6c16355039b0cf"));
    }

    /// The classifier's stream over several epochs: each epoch holds every
    /// training example once (the short last batch filled with ignored
    /// rows), and each epoch's order is its own (the epoch is part of the
    /// shuffle's seed).
    #[test]
    fn each_epoch_is_a_permutation_in_an_order_of_its_own() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference_runs/classify");
        let t = 12;
        let task =
            ClassifyTask::new(&fixture.join("init"), &fixture.join("data"), None, t, 3).unwrap();
        let examples = &task.set.train.examples;
        let rows: Vec<Vec<u32>> = examples
            .iter()
            .map(|e| {
                let mut ids = task.wp.encode_for_classifier(&e.text, t);
                ids.resize(t, task.wp.pad);
                ids
            })
            .collect();
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(
                rows.iter().filter(|s| *s == r).count(),
                1,
                "example {i} is not unique"
            );
        }
        let cfg = TrainConfig {
            batch_size: 4,
            seq_len: t,
            seed: 3,
            ..TrainConfig::default()
        };
        let mut stream = Task::<crate::backend::cpu::Cpu>::train_stream(&task, &cfg).unwrap();
        let per_epoch = stream.batches_per_epoch();
        assert_eq!(per_epoch, examples.len().div_ceil(4));
        let orders: Vec<Vec<usize>> = (0..4)
            .map(|_| {
                let mut order = Vec::new();
                for _ in 0..per_epoch {
                    let b = stream.next_batch(0);
                    for (row, &label) in b.inputs.chunks(t).zip(&b.targets) {
                        if label == IGNORE {
                            assert_eq!(row[..2], [task.wp.cls, task.wp.sep]);
                            continue;
                        }
                        let e = rows
                            .iter()
                            .position(|r| r == row)
                            .expect("a training example");
                        assert_eq!(label, examples[e].label);
                        order.push(e);
                    }
                }
                order
            })
            .collect();
        crate::data::loader::tests::assert_epochs_permute(&orders, examples.len());
    }

    /// An epoch's tokens are its examples' real tokens: a short last
    /// batch's filler rows ([CLS] [SEP], label ignored) count none (they
    /// counted 2 each in tokens/s and MFU).
    #[test]
    fn an_epochs_tokens_are_its_examples_without_filler_rows() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference_runs/classify");
        let (init, data) = (fixture.join("init"), fixture.join("data"));
        let task = ClassifyTask::new(&init, &data, None, 12, 3).unwrap();
        let examples = &task.set.train.examples;
        assert_ne!(examples.len() % 4, 0, "the last batch has filler rows");
        let real: usize = (examples.iter())
            .map(|e| (task.wp.encode_pair(&e.text, e.text_pair.as_deref(), 12).0).len())
            .sum();
        let cfg = TrainConfig {
            batch_size: 4,
            seq_len: 12,
            ..TrainConfig::default()
        };
        let mut stream = Task::<crate::backend::cpu::Cpu>::train_stream(&task, &cfg).unwrap();
        let counted: usize = (0..stream.batches_per_epoch())
            .map(|_| Task::<crate::backend::cpu::Cpu>::tokens(&task, &stream.next_batch(0)))
            .sum();
        assert_eq!(counted, real);
    }

    /// `--seed` takes any u64: the second epoch's order is drawn from the
    /// seed plus the epoch, which overflowed (a panic in a debug build).
    #[test]
    fn the_largest_seed_orders_a_second_epoch() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference_runs/classify");
        let (init, data) = (fixture.join("init"), fixture.join("data"));
        let task = ClassifyTask::new(&init, &data, None, 12, 3).unwrap();
        let cfg = TrainConfig {
            batch_size: 4,
            seq_len: 12,
            seed: u64::MAX,
            ..TrainConfig::default()
        };
        let mut stream = Task::<crate::backend::cpu::Cpu>::train_stream(&task, &cfg).unwrap();
        for _ in 0..=stream.batches_per_epoch() {
            stream.next_batch(0);
        }
    }

    #[test]
    fn f1_is_the_positive_labels_for_two_labels_and_the_mean_otherwise() {
        // tp 2, fp 1, fn 1 for label 1: F1 = 4 / 6
        let pairs = [(1, 1), (1, 1), (1, 0), (0, 1), (0, 0)];
        let s = Scores::of(&pairs, 2, 0.5);
        assert!((s.accuracy - 0.6).abs() < 1e-12 && (s.f1 - 4.0 / 6.0).abs() < 1e-12);
        let s = Scores::of(&[(0, 0), (1, 1), (2, 1)], 3, 0.0);
        // label 0: 1; label 1: 2/3; label 2: 0
        assert!((s.f1 - (1.0 + 2.0 / 3.0) / 3.0).abs() < 1e-12);
        // sklearn's macro F1 leaves out a label neither true nor predicted
        // (f1_score([0, 1], [0, 1], average="macro") is 1 for 3 labels)
        let s = Scores::of(&[(0, 0), (1, 1)], 3, 0.0);
        assert_eq!(s.f1, 1.0);
    }

    /// Equal highest logits predict the first of them, as numpy's and
    /// torch's argmax do (the last was taken).
    #[test]
    fn a_tie_predicts_the_first_of_the_highest_logits() {
        let logits = [0.5, 2.0, 2.0, 1.0, 1.0, 1.0];
        assert_eq!(predicted(&logits, &[1, 2], 3), [(1, 1), (0, 2)]);
    }
}
