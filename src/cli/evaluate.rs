//! `distgpt eval`: a model's loss (and a classifier's accuracy and F1) on a split of its data, on any device and layout.

use super::*;
use distgpt::model::bert::BertHead;

#[derive(Args)]
pub(super) struct EvalArgs {
    /// A run directory, one of its checkpoint directories, a Hugging Face
    /// GPT-2 folder, or a BERT folder with its head: a classifier (`train
    /// --task classify`'s output), a masked LM or a pretraining model.
    #[arg(value_name = "RUN")]
    model: PathBuf,
    /// Data: a text file or a shard directory (default: the data its run trained on, else the embedded corpus); its validation split is used.
    /// For a BERT classifier: a labelled set, whose test split is scored (accuracy, F1);
    /// default: the one its run trained on.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per batch.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size; a BERT classifier: its run's own, else 128, or its positions where fewer).
    #[arg(long, value_parser = positive())]
    seq_len: Option<usize>,
    /// Batches to evaluate (0: the whole split).
    #[arg(long, default_value_t = 50)]
    batches: usize,
    /// Weights to evaluate with: f32 runs the training forward; bf16 and
    /// int8 run the KV-cache decoder (as `generate` does) beside an fp32
    /// one, and also report how often their next-token choices agree.
    #[arg(long, value_enum, default_value = "f32")]
    weights: WeightFormat,
    #[command(flatten)]
    device: DeviceArgs,
}

/// The record of the run `model` is, or whose checkpoint it is (none for
/// a folder from elsewhere).
fn run_record(model: &Path) -> Option<train::RunRecord> {
    train::run_dir::read_record(model).ok().or_else(|| {
        let run = model.parent()?.parent()?;
        train::run_dir::read_record(run).ok()
    })
}

/// `--data`, else the data `record` (the model's run) trained on; a
/// recorded file that is gone is refused naming it, not as the OS's
/// "No such file".
fn data_of(a: &EvalArgs, record: Option<&train::RunRecord>) -> Result<Option<PathBuf>> {
    if a.data.is_some() {
        return Ok(a.data.clone());
    }
    let recorded = record.and_then(|r| r.train.data.clone());
    if let Some(gone) = recorded.as_ref().filter(|d| !d.exists()) {
        bail!(
            "{} trained on {}, which is no longer there (its run.json records it): give --data",
            a.model.display(),
            gone.display()
        );
    }
    Ok(recorded)
}

/// `eval` of a BERT masked LM (a `--task mlm` run, one of its checkpoints,
/// or such a folder): the masked-token loss on the validation split of
/// --data, or of the run's own data with its seed's masks, tokenized as
/// the model recorded.
fn eval_masked_lm<B: Backend + 'static>(
    be: B,
    a: &EvalArgs,
    given: &[String],
    bert: &distgpt::model::bert::BertConfig,
) -> Result<()> {
    if given.iter().any(|g| g == "weights") {
        bail!(
            "--weights is for GPT-2 models: a BERT {} is evaluated in fp32",
            match bert.head {
                distgpt::model::bert::BertHead::Pretrain =>
                    "pretrained with next-sentence prediction",
                _ => "masked LM",
            }
        );
    }
    let record = run_record(&a.model);
    let data = data_of(a, record.as_ref())?;
    // the length its run trained and scored at (a folder's positions may be more)
    let recorded = record.as_ref().map(|r| r.train.seq_len);
    let cfg = TrainConfig {
        batch_size: a.batch_size,
        seq_len: a.seq_len.or(recorded).unwrap_or(bert.block_size),
        eval_batches: if a.batches == 0 {
            usize::MAX
        } else {
            a.batches
        },
        seed: record.map_or(1337, |r| r.train.seed),
        ..TrainConfig::default()
    };
    // before the data is read and tokenized
    train::mlm::check_seq_len(bert.head, cfg.seq_len)?;
    let threads = rayon::current_num_threads();
    // the model's own tokenizer: a character it never saw is an error
    let ds = Dataset::load_with(data.as_deref(), train::mlm::recorded_tokenizer(&a.model)?)?;
    let e = train::mlm::evaluate_folder(be, &a.model, &ds, &cfg, threads)?;
    // pretraining's figures: the sum of its two means, and the accuracy
    let figures = match e.accuracy {
        Some(acc) => format!(
            "masked-LM + next-sentence loss {:.4}, next-sentence accuracy {:.2}%, F1 {:.4}",
            e.loss,
            100.0 * acc,
            e.f1.unwrap_or(0.0)
        ),
        None => format!("masked-token loss {:.4}", e.loss),
    };
    distgpt::outln!(
        "{} on {}'s validation split: {figures} ({} sequences of {} tokens)",
        a.model.display(),
        ds.name,
        e.examples,
        cfg.seq_len
    );
    Ok(())
}

/// `eval` of a BERT classifier: its test split's loss, accuracy and F1, at
/// the sequence length its run trained and scored at unless --seq-len says.
fn eval_classifier<B: Backend + 'static>(
    be: B,
    a: &EvalArgs,
    given: &[String],
    block: usize,
) -> Result<()> {
    // the labelled set and sequence length the run recorded, unless given
    let record = run_record(&a.model).filter(|r| r.task == TaskKind::Classify);
    let Some(data) = data_of(a, record.as_ref())? else {
        bail!(
            "{} is a BERT classifier without a run record naming its data: give --data, a labelled set (its test split is scored)",
            a.model.display()
        );
    };
    for flag in ["batches", "weights"] {
        if given.iter().any(|g| g == flag) {
            bail!("--{flag} is for language models: a BERT classifier is scored on the whole test split in fp32");
        }
    }
    let recorded = record.map(|r| r.train.seq_len);
    let t = a
        .seq_len
        .or(recorded)
        .unwrap_or(block.min(train::classify::DEFAULT_SEQ_LEN));
    let other = match recorded {
        Some(r) if r != t => format!("; its run trained and scored at --seq-len {r}"),
        _ => String::new(),
    };
    let s = train::classify::evaluate_folder(
        be,
        &a.model,
        &data,
        a.batch_size,
        t,
        rayon::current_num_threads(),
    )?;
    distgpt::outln!(
        "{} on {}'s test split: loss {:.4}, accuracy {:.2}%, F1 {:.4} ({} examples at --seq-len {t}{other})",
        a.model.display(),
        data.display(),
        s.loss,
        100.0 * s.accuracy,
        s.f1,
        s.examples
    );
    Ok(())
}

/// `eval` on the device asked for (opened first: a device that cannot run
/// is the error, whatever the folder).
pub(super) fn run_eval(a: EvalArgs, given: &[String]) -> Result<()> {
    a.device.run(Eval(&a, given))
}

/// `eval` on a backend: what the folder's own records say it is (its
/// family and, for a BERT, its head) decides what is measured, never what
/// a GPT-2 run would be.
struct Eval<'a>(&'a EvalArgs, &'a [String]);

impl OnBackend for Eval<'_> {
    type Out = Result<()>;
    fn run<B: Backend>(self, be: B) -> Result<()> {
        let Eval(a, given) = self;
        let meta = checkpoint::read_any_meta(&a.model)?;
        let Some(bert) = meta.config.bert() else {
            return eval_on(be, a);
        };
        match bert.head {
            BertHead::Mlm | BertHead::Pretrain => eval_masked_lm(be, a, given, bert),
            BertHead::Classify { .. } => eval_classifier(be, a, given, bert.block_size),
        }
    }
}

/// A language model's validation loss, of any family: through its engine
/// in fp32, or (a family with a decoder) decoded with its weights stored
/// as `--weights`.
pub(super) fn eval_on<B: Backend>(be: B, a: &EvalArgs) -> Result<()> {
    let (meta, params) = checkpoint::read_model(&a.model)?;
    // the data the run trained on unless given, as a BERT's eval reads it
    let data = data_of(a, run_record(&a.model).as_ref())?;
    let ds = Dataset::load_for_model(data.as_deref(), &meta.tokenizer)?;
    let t = a.seq_len.unwrap_or(meta.config.block_size());
    let mut val = distgpt::data::DataLoader::new(&ds.val, "val", a.batch_size, t, 0, false)?;
    let n = if a.batches == 0 {
        val.batches_per_epoch()
    } else {
        a.batches.min(val.batches_per_epoch())
    };
    if a.weights != WeightFormat::F32 {
        let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..n)
            .map(|_| {
                let b = val.next_batch();
                (b.inputs, b.targets)
            })
            .collect();
        let format = a.weights;
        let run = distgpt::model::family::DecodedRun {
            params: &params,
            format,
            batches,
            rows: a.batch_size,
            t,
        };
        let e = meta.config.decoder("eval --weights")?.evaluate(be, run)?;
        distgpt::outln!(
            "{}: val loss {:.4} with {} weights, {:.4} with fp32 ({:+.2}%); next-token top-1 agrees with fp32 at {:.2}% of {} positions ({n} batches of {} x {t} tokens from {})",
            a.model.display(),
            e.loss,
            format.name(),
            e.loss_f32,
            100.0 * (e.loss / e.loss_f32 - 1.0),
            100.0 * e.top1_agreement,
            e.tokens,
            a.batch_size,
            ds.name
        );
        return Ok(());
    }
    let pb = metrics::progress_bar(n as u64, "eval");
    // without a terminal the bar is hidden: a line says what is under way
    if pb.is_hidden() {
        distgpt::errln!(
            "eval: {n} batches of {} x {t} tokens from {}",
            a.batch_size,
            ds.name
        );
    }
    let batches = (0..n).map(|_| {
        pb.inc(1);
        val.next_batch()
    });
    let loss = meta
        .config
        .whole(be, &params)?
        .mean_loss(batches, a.batch_size, t)?;
    pb.finish_and_clear();
    distgpt::outln!(
        "{}: val loss {loss:.4}, perplexity {:.2} ({n} batches of {} x {t} tokens from {})",
        a.model.display(),
        loss.exp(),
        a.batch_size,
        ds.name
    );
    Ok(())
}
