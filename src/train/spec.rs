//! Tasks as data, beside the families' registrations: what `train`, its
//! `--config` files, `compare` and the library read of a task (the
//! settings it has not, its defaults, what it trains) and a task's data
//! read once and shared by every rank ([`TaskData`]), made anew from a run
//! record on resume. A new task is a [`TaskKind`], its module's
//! [`Task`] and an entry of [`TASKS`].

use super::classify::ClassifyTask;
use super::lm::LmTask;
use super::mlm::MlmTask;
use super::task::{Task, TaskKind};
use super::{Duration, RunRecord, TrainConfig};
use crate::backend::cpu::Cpu;
use crate::backend::Backend;
use crate::data::{Dataset, Tokenizer, TokenizerKind, TokenizerSpec};
use crate::error::{Error, Result};
use crate::model::bert::{BertConfig, BertHead};
use crate::model::ModelConfig;
use std::path::Path;

/// A task's defaults where they differ from the flags' own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TaskDefaults {
    pub lr: Option<f32>,
    pub beta2: Option<f32>,
    pub weight_decay: Option<f32>,
    /// Trains this many epochs when neither steps nor epochs are given.
    pub epochs: Option<f64>,
    /// Validates every this many steps (0: at each epoch's end only).
    pub eval_every: Option<usize>,
    /// Its sequence length when none is given (None: the model's own).
    pub seq_len: Option<usize>,
}

/// What a new run of a task is made from: the command line's settings (or
/// a library caller's).
pub struct TaskInputs<'a> {
    /// The model asked for (`--model` and its shape flags) with a
    /// vocabulary of the given size (None: the preset's own).
    pub model: &'a dyn Fn(Option<usize>) -> Result<ModelConfig>,
    /// Weights to start from: a run, checkpoint or model folder.
    pub init_from: Option<&'a Path>,
    /// A text file, a folder of token shards, or a labelled set.
    pub data: Option<&'a Path>,
    pub tokenizer: TokenizerKind,
    /// Whether the tokenizer was asked for (a shard folder keeps its own).
    pub tokenizer_given: bool,
    pub seq_len: Option<usize>,
    /// The positions asked for (`--block-size`): an encoder trained from
    /// scratch takes them, where it would take the sequence length's.
    pub block_size: Option<usize>,
    pub train_examples: Option<usize>,
    pub seed: u64,
}

/// What a task is to everything that is not its own module.
pub struct TaskSpec {
    pub kind: TaskKind,
    /// What it trains, as a sentence's object ("a BERT").
    pub trains: &'static str,
    /// Settings it has not (train's flags as their `snake_case` ids), each
    /// with why, as `--flag why` says it.
    pub refuses: &'static [(&'static str, &'static str)],
    pub defaults: TaskDefaults,
    /// A new run's default folder name (None: the model's name).
    pub run_name: Option<&'static str>,
    /// What its training loss is, in a run's summary.
    pub loss: &'static str,
    /// Its loss's unit, on a figure's axis.
    pub loss_unit: &'static str,
    /// What its evaluation's accuracy and F1 score ("" for the task's
    /// own labels).
    pub scores_of: &'static str,
    /// Its data, model and sequence length, made from a new run's inputs.
    pub build: fn(&TaskInputs<'_>) -> Result<(TaskData, usize)>,
}

const NOT_A_GENERATOR: &str = "is for GPT-2 language models (an encoder does not generate)";
/// `--train-examples`, which only classifiers take.
const CLASSIFY_ONLY: (&str, &str) = (
    "train_examples",
    "is for --task classify (a sample of a labelled set's training examples)",
);

/// Every task `train --task` offers.
pub const TASKS: [TaskSpec; 4] = [
    TaskSpec {
        kind: TaskKind::Lm,
        trains: "a causal language model (GPT-2, or any family registered as one)",
        refuses: &[CLASSIFY_ONLY],
        defaults: TaskDefaults {
            lr: None,
            beta2: None,
            weight_decay: None,
            epochs: None,
            eval_every: None,
            seq_len: None,
        },
        run_name: None,
        loss: "loss",
        loss_unit: "nats/token",
        scores_of: "",
        build: build_lm,
    },
    TaskSpec {
        kind: TaskKind::Mlm,
        trains: "a BERT masked language model",
        refuses: &[
            ("sample_every", NOT_A_GENERATOR),
            ("sample_tokens", NOT_A_GENERATOR),
            (
                "tokenizer",
                "is for GPT-2 language models: --task mlm tokenizes with its --init-from folder's vocab.txt, a shard folder's (`data prepare --tokenizer wordpiece`), or a plain text's characters",
            ),
            CLASSIFY_ONLY,
        ],
        defaults: MASKED_DEFAULTS,
        run_name: None,
        loss: "masked-token loss",
        loss_unit: "nats/masked token",
        scores_of: "",
        build: build_mlm,
    },
    TaskSpec {
        kind: TaskKind::Classify,
        trains: "a BERT sequence classifier",
        refuses: &[
            ("sample_every", NOT_A_GENERATOR),
            ("sample_tokens", NOT_A_GENERATOR),
            (
                "eval_batches",
                "is for language models: a classifier is scored on its whole validation split",
            ),
            (
                "tokenizer",
                "is for GPT-2 language models: --task classify reads the folder's vocab.txt",
            ),
        ],
        // BERT fine-tuning's usual settings
        defaults: TaskDefaults {
            lr: Some(5e-5),
            beta2: Some(0.999),
            weight_decay: Some(0.01),
            epochs: Some(3.0),
            eval_every: Some(0),
            seq_len: None,
        },
        run_name: Some("classify"),
        loss: "loss",
        loss_unit: "nats/sequence",
        scores_of: "",
        build: build_classify,
    },
    TaskSpec {
        kind: TaskKind::Pretrain,
        trains: "a BERT with masked-LM and next-sentence heads",
        refuses: &[
            ("sample_every", NOT_A_GENERATOR),
            ("sample_tokens", NOT_A_GENERATOR),
            (
                "tokenizer",
                "is for GPT-2 language models: --task pretrain tokenizes with its --init-from folder's vocab.txt or a shard folder's (`data prepare --tokenizer wordpiece`)",
            ),
            CLASSIFY_ONLY,
        ],
        defaults: MASKED_DEFAULTS,
        run_name: None,
        loss: "masked-LM + next-sentence loss",
        loss_unit: "nats/masked token + nats/sequence",
        scores_of: "next-sentence ",
        build: build_pretrain,
    },
];

/// The defaults of a masked LM and of BERT's pretraining.
const MASKED_DEFAULTS: TaskDefaults = TaskDefaults {
    lr: Some(1e-3),
    beta2: None,
    weight_decay: None,
    epochs: None,
    eval_every: None,
    seq_len: Some(MLM_SEQ_LEN),
};

/// A masked LM's sequence length when none is given.
const MLM_SEQ_LEN: usize = 128;

/// A causal language model of any family but BERT's: on a text or shards
/// (`--tokenizer` checked against a shard folder's), or continuing the
/// weights of `init_from` on its tokenizer.
fn build_lm(i: &TaskInputs<'_>) -> Result<(TaskData, usize)> {
    let (model, ds) = match i.init_from {
        Some(dir) => {
            let meta = crate::checkpoint::read_any_meta(dir)?;
            // said before its tokenizer is, whose words are an encoder's
            if !meta.config.registration().causal {
                return Err(Error::Config(format!(
                    "{} holds a {} ({}): --task lm trains {}; --task mlm continues its pretraining, --task classify fine-tunes it",
                    dir.display(),
                    meta.config.family(),
                    meta.config,
                    TaskKind::Lm.spec().trains
                )));
            }
            let ds = Dataset::load_for_model(i.data, &meta.tokenizer)?;
            (meta.config, ds)
        }
        None => {
            let ds = Dataset::load(i.data, i.tokenizer)?;
            if let Some(dir) = i.data.filter(|d| i.tokenizer_given && d.is_dir()) {
                ds.refuse_other_tokenizer(dir, i.tokenizer)?;
            }
            if let Tokenizer::WordPiece(_) = ds.tokenizer {
                return Err(Error::Config(format!(
                    "{} holds shards of a WordPiece vocabulary, which BERT's --task mlm reads: \
                     --task lm trains on characters or GPT-2 BPE (`data prepare --tokenizer char|gpt2`)",
                    ds.name
                )));
            }
            ((i.model)(Some(ds.tokenizer.vocab_size()))?, ds)
        }
    };
    if !model.registration().causal {
        return Err(Error::Config(format!(
            "{model} is a {}: --task lm trains {}; --task mlm pretrains a BERT, --task classify fine-tunes one",
            model.family(),
            TaskKind::Lm.spec().trains
        )));
    }
    let seq = i.seq_len.unwrap_or(model.block_size());
    Ok((TaskData::Lm { model, ds }, seq))
}

/// A BERT masked LM: continued pretraining of `--init-from` (a BERT
/// folder, run or checkpoint, on its own WordPiece vocabulary), or from
/// scratch on shards prepared with a WordPiece vocabulary or a plain text's
/// characters.
fn build_mlm(i: &TaskInputs<'_>) -> Result<(TaskData, usize)> {
    build_masked(i, BertHead::Mlm)
}

/// BERT's pretraining (masked LM and next-sentence prediction) as
/// [`build_mlm`], on WordPiece tokens only.
fn build_pretrain(i: &TaskInputs<'_>) -> Result<(TaskData, usize)> {
    let (data, seq) = build_masked(i, BertHead::Pretrain)?;
    super::mlm::check_seq_len(BertHead::Pretrain, seq)?;
    Ok((data, seq))
}

/// A masked LM (`head` Mlm) or BERT's pretraining (Pretrain).
fn build_masked(i: &TaskInputs<'_>, head: BertHead) -> Result<(TaskData, usize)> {
    let seq = i
        .seq_len
        .unwrap_or(i.block_size.map_or(MLM_SEQ_LEN, |b| b.min(MLM_SEQ_LEN)));
    let task = super::mlm::task_of(head);
    if let Some(dir) = i.init_from {
        let (model, _, wp, _) =
            super::classify::pretrained_bert(dir, head, i.seed, &task.to_string())?;
        if seq > model.block_size {
            return Err(Error::Config(format!(
                "--seq-len {seq}: {} has {} positions",
                dir.display(),
                model.block_size
            )));
        }
        let ds = Dataset::load_with(i.data, Tokenizer::WordPiece(Box::new(wp)))?;
        return Ok((TaskData::Mlm { model, ds }, seq));
    }
    let Some(shape) = (i.model)(None)?.bert().cloned() else {
        return Err(Error::Config(format!(
            "--task {task} trains {}: choose --model bert-tiny, bert-minilm or bert-base, or --init-from a BERT folder",
            task.spec().trains
        )));
    };
    let ds = Dataset::load(i.data, TokenizerKind::Char)?;
    // the model first: pretraining refuses characters before any note on them
    let positions = match i.block_size {
        Some(b) if seq > b => {
            return Err(Error::Config(format!(
                "--seq-len {seq} must be between 1 and the model's block size {b} (--block-size)"
            )))
        }
        Some(b) => b,
        None => seq,
    };
    let mlm = MlmTask::new(&shape, &ds, positions);
    let model = match head {
        BertHead::Pretrain => mlm.pretraining()?.model,
        _ => mlm.model,
    };
    if let TokenizerSpec::Char { chars } = ds.tokenizer.spec() {
        crate::errln!(
            "note: --task {task} on {}: no WordPiece vocabulary (no --init-from, and not a folder of `data prepare --tokenizer wordpiece`), so its {} characters are the tokens, and the model can start only another character-level run",
            ds.name,
            chars.chars().count()
        );
    }
    if ds.tokenizer.spec() == TokenizerSpec::Gpt2 && head != BertHead::Pretrain {
        crate::errln!(
            "note: --task {task} on {}: GPT-2 BPE shards, so GPT-2's ids are the tokens ([MASK] one past them); the model's folder holds no vocabulary a BERT tokenizer reads (no vocab.txt)",
            ds.name
        );
    }
    Ok((TaskData::Mlm { model, ds }, seq))
}

/// A BERT folder fine-tuned as a classifier of a labelled set.
fn build_classify(i: &TaskInputs<'_>) -> Result<(TaskData, usize)> {
    let (Some(init_from), Some(data)) = (i.init_from, i.data) else {
        return Err(Error::Config(
            "--task classify needs --init-from (a Hugging Face BERT folder, e.g. all-MiniLM-L6-v2's) and --data (a labelled set)".into(),
        ));
    };
    let seq = i
        .seq_len
        .unwrap_or_else(|| super::classify::default_seq_len(init_from));
    let t = ClassifyTask::new(init_from, data, i.train_examples, seq, i.seed)?
        .for_a_new_run(init_from, i.seed);
    Ok((TaskData::Classify(t), seq))
}

impl TaskKind {
    /// This task's entry of [`TASKS`].
    pub fn spec(self) -> &'static TaskSpec {
        TASKS
            .iter()
            .find(|s| s.kind == self)
            .expect("every task has a spec")
    }

    /// The model a run of this task trains from `shape` (a preset and its
    /// flags) where `run` is the model one such run trained: a masked
    /// LM's positions are its sequence length and its head the task's,
    /// whatever the preset's, so a resume given the run's own `--model`
    /// compares like with like.
    pub fn as_trained(self, shape: ModelConfig, run: &ModelConfig) -> ModelConfig {
        match (self, shape.bert(), run.bert()) {
            (TaskKind::Mlm | TaskKind::Pretrain, Some(s), Some(r)) => BertConfig {
                block_size: r.block_size,
                head: r.head,
                ..s.clone()
            }
            .into(),
            _ => shape,
        }
    }
}

impl TaskSpec {
    /// Refuses the first setting of `given` (flag ids) this task has not.
    pub fn refuse(&self, given: &[String]) -> Result<()> {
        match self
            .refuses
            .iter()
            .find(|(f, _)| given.iter().any(|g| g == f))
        {
            Some((flag, why)) => Err(Error::Config(format!("--{} {why}", flag.replace('_', "-")))),
            None => Ok(()),
        }
    }

    /// Whether this task has setting `flag` (an id of train's flags).
    pub fn has(&self, flag: &str) -> bool {
        !self.refuses.iter().any(|(f, _)| *f == flag)
    }

    /// `cfg` with this task's defaults where `given` (whether a flag was
    /// given) says the setting was left to it; a task that does not
    /// generate samples nothing.
    pub fn apply_defaults(&self, cfg: &mut TrainConfig, given: impl Fn(&str) -> bool) {
        let d = &self.defaults;
        if let (Some(lr), false) = (d.lr, given("lr")) {
            cfg.lr = lr;
            if !given("min_lr") {
                cfg.min_lr = lr / 10.0;
            }
        }
        if let (Some(b), false) = (d.beta2, given("beta2")) {
            cfg.adamw.beta2 = b;
        }
        if let (Some(w), false) = (d.weight_decay, given("weight_decay")) {
            cfg.adamw.weight_decay = w;
        }
        if let (Some(e), false) = (d.epochs, given("steps") || given("epochs")) {
            cfg.duration = Duration::Epochs(e);
        }
        if let (Some(n), false) = (d.eval_every, given("eval_every")) {
            cfg.eval_every = n;
        }
        if !self.has("sample_tokens") {
            cfg.sample_tokens = 0;
        }
    }
}

/// A task's data, read once and shared by every rank.
pub enum TaskData {
    /// A causal language model of any family over a text.
    Lm {
        model: ModelConfig,
        ds: Dataset,
    },
    Mlm {
        model: BertConfig,
        ds: Dataset,
    },
    Classify(ClassifyTask),
}

impl TaskData {
    /// A new run's task of kind `kind` from `inputs`, with its sequence length.
    pub fn new(kind: TaskKind, inputs: &TaskInputs<'_>) -> Result<(TaskData, usize)> {
        let built = (kind.spec().build)(inputs)?;
        if let Some(dir) = inputs.init_from.map(crate::checkpoint::model_dir) {
            let asked = crate::model::family::hf_dropout(&dir);
            if !asked.is_empty() {
                crate::errln!(
                    "note: {} asks for dropout in training ({}); distgpt trains without dropout (as llm.c does), and its exports say 0",
                    dir.join("config.json").display(),
                    asked.join(", ")
                );
            }
        }
        Ok(built)
    }

    pub fn kind(&self) -> TaskKind {
        self.with_task::<Cpu, _>(|t| t.kind())
    }

    pub fn model(&self) -> ModelConfig {
        self.with_task::<Cpu, _>(|t| t.model())
    }

    /// Calls `f` with the task.
    pub fn with_task<B: Backend, R>(&self, f: impl FnOnce(&dyn Task<B>) -> R) -> R {
        match self {
            TaskData::Lm { model, ds } => f(&LmTask {
                model: model.clone(),
                data: ds,
            }),
            TaskData::Mlm { model, ds } => f(&MlmTask {
                model: model.clone(),
                data: ds,
            }),
            TaskData::Classify(t) => f(t),
        }
    }

    /// The task a run in `run_dir` trains, from its record and its
    /// checkpoint's tokenizer: its data read again from where the record
    /// says.
    pub fn from_record(
        record: &RunRecord,
        tokenizer: &TokenizerSpec,
        run_dir: &Path,
    ) -> Result<TaskData> {
        let cfg = &record.train;
        let bad = |what: String| Error::Input(format!("{}'s run record {what}", run_dir.display()));
        Ok(match record.task {
            TaskKind::Classify => {
                let (Some(init_from), Some(data)) = (&cfg.init_from, &cfg.data) else {
                    return Err(bad("names no pretrained folder or labelled set".into()));
                };
                TaskData::Classify(ClassifyTask::new(
                    init_from,
                    data,
                    cfg.train_examples,
                    cfg.seq_len,
                    cfg.seed,
                )?)
            }
            TaskKind::Mlm | TaskKind::Pretrain => {
                let Some(bert) = record.model.bert() else {
                    return Err(bad(format!(
                        "names a --task {} run of a {}",
                        record.task, record.model
                    )));
                };
                // a WordPiece vocabulary is kept in the run's checkpoints
                let ckpt = crate::checkpoint::state::latest(run_dir)?;
                let ds = Dataset::load_with(
                    cfg.data.as_deref(),
                    Tokenizer::from_spec_in(tokenizer, &ckpt)?,
                )?;
                TaskData::Mlm {
                    model: bert.clone(),
                    ds,
                }
            }
            TaskKind::Lm => {
                if !record.model.registration().causal {
                    return Err(bad(format!("names a --task lm run of a {}", record.model)));
                }
                let ds = Dataset::load_for_model(cfg.data.as_deref(), tokenizer)?;
                TaskData::Lm {
                    model: record.model.clone(),
                    ds,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_has_one_spec_and_defaults_apply_only_where_no_flag_was_given() {
        for kind in [
            TaskKind::Lm,
            TaskKind::Mlm,
            TaskKind::Classify,
            TaskKind::Pretrain,
        ] {
            assert_eq!(kind.spec().kind, kind);
        }
        let classify = TaskKind::Classify.spec();
        let mut cfg = TrainConfig {
            eval_every: 50,
            ..TrainConfig::default()
        };
        classify.apply_defaults(&mut cfg, |_| false);
        assert_eq!((cfg.lr, cfg.min_lr), (5e-5, 5e-6));
        assert_eq!((cfg.adamw.beta2, cfg.adamw.weight_decay), (0.999, 0.01));
        assert!(matches!(cfg.duration, Duration::Epochs(e) if e == 3.0));
        assert_eq!((cfg.eval_every, cfg.sample_tokens), (0, 0));
        let before = TrainConfig::default();
        let mut given = TrainConfig::default();
        classify.apply_defaults(&mut given, |f| f != "beta2");
        assert_eq!(given.lr, before.lr);
        assert_eq!(given.adamw.weight_decay, before.adamw.weight_decay);
        assert_eq!(given.adamw.beta2, 0.999);
        let e = classify.refuse(&["sample_every".into()]).unwrap_err();
        assert!(e.to_string().contains("--sample-every is for GPT-2"), "{e}");
        assert!(TaskKind::Lm.spec().refuse(&["sample_every".into()]).is_ok());
        // what `--config RUN/run.json` writes of a run: only its task's settings
        assert!(TaskKind::Lm.spec().has("tokenizer") && TaskKind::Lm.spec().has("sample_every"));
        assert!(!TaskKind::Mlm.spec().has("tokenizer") && TaskKind::Mlm.spec().has("eval_batches"));
        assert!(!classify.has("eval_batches") && classify.has("train_examples"));
    }
}
