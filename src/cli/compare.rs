//! `distgpt compare`: the strategy matrix in one command, with a report.

use anyhow::{bail, Context, Result};
use clap::Args;
use distgpt::compare::classify::{self as classify_matrix, ClassifyMatrix, ClassifyRow};
use distgpt::compare::{self, CompareSpec, Layout};
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::family::Reshape;
use distgpt::model::ModelConfig;
use distgpt::train::classify::ClassifyTask;
use distgpt::train::TrainConfig;
use distgpt::train::{Duration, TaskKind};
use indicatif::MultiProgress;
use std::path::{Path, PathBuf};

/// What the matrix trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CompareTask {
    /// GPT-2 language models (--models) on text or token shards.
    Lm,
    /// Fine-tuning a Hugging Face BERT folder (--init-from) on a labelled set (--data).
    Classify,
}

#[derive(Args)]
pub struct CompareArgs {
    /// A small matrix that finishes in a few minutes on 2 cores: the
    /// --strategies (by default the seven without pipelines) on 2 and 4
    /// ranks, batches 8 and 16; 4 epochs over 8k tokens (lm) or 2 epochs
    /// over 256 examples (classify). It sets the sizes and the length, so
    /// it is refused beside --world-sizes, --batch-sizes, --steps or --epochs.
    #[arg(long, conflicts_with_all = ["world_sizes", "batch_sizes", "steps", "epochs"])]
    quick: bool,
    /// What every run trains.
    #[arg(long, value_enum, default_value = "lm")]
    task: CompareTask,
    /// Model presets, comma-separated (lm; default shakespeare-char-small).
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    /// The Hugging Face BERT folder every run fine-tunes (classify).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Fine-tune on N training examples only, a sample drawn with --seed (classify).
    #[arg(long)]
    train_examples: Option<usize>,
    /// Strategies, comma-separated (mesh: ddp over tensor-parallel pairs;
    /// pp, gpipe: ddp over 2-stage pipelines, 1f1b or gpipe, drawn as timelines).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "single,ddp,zero1,zero2,fsdp,tp,mesh"
    )]
    strategies: Vec<Layout>,
    /// Micro-batches per optimizer step in every run (a pipeline streams
    /// them; language models only).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    grad_accum: u64,
    /// World sizes of the parallel strategies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    world_sizes: Vec<usize>,
    /// Global batches (sequences per micro-step, split across the data-parallel ranks), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32")]
    batch_sizes: Vec<usize>,
    /// Tokens per sequence (default 64; classify: at most, default 128 or the model's positions where fewer).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Optimizer steps per run (instead of --epochs).
    #[arg(long, conflicts_with = "epochs")]
    steps: Option<usize>,
    /// Passes over the training split per run (default 1; classify: whole epochs, default 2).
    #[arg(long)]
    epochs: Option<f64>,
    /// Train on the first N tokens of the training split only (shorter epochs).
    #[arg(long)]
    train_tokens: Option<usize>,
    /// Training data: a text file or a directory of token shards (default:
    /// embedded Shakespeare); classify: a labelled set (`data prepare-spam`).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokenizer for text data: char or gpt2 (BPE).
    #[arg(long, value_enum)]
    tokenizer: Option<TokenizerKind>,
    /// Peak learning rate of every run, then a cosine to lr / 10 (default
    /// 3e-3 after 10 warmup steps; classify: 5e-5 after 10% of the steps).
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f32>,
    /// Seed of the initial weights and the data order, the same for every run.
    #[arg(long, value_parser = super::seed, allow_negative_numbers = true, default_value_t = 1337)]
    seed: u64,
    /// Validation batches at the end of each run (lm; default 8).
    #[arg(long, value_parser = super::positive())]
    eval_batches: Option<usize>,
    /// Runs of each cell: tables show the median step time, figures its
    /// min-max range (default: 3 with --quick, else 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: Option<u32>,
    /// Skip `plan`'s predictions (and the calibration they need).
    #[arg(long)]
    no_predict: bool,
    /// Report directory (default: reports/compare-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write into --out even when it already holds files.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(mut a: CompareArgs, threads: usize) -> Result<()> {
    if a.batch_sizes.contains(&0) || a.world_sizes.contains(&0) {
        bail!("--batch-sizes and --world-sizes must be at least 1");
    }
    once_each("--strategies", &a.strategies)?;
    once_each("--world-sizes", &a.world_sizes)?;
    once_each("--batch-sizes", &a.batch_sizes)?;
    if let Some(out) = &a.out {
        super::claim_out(out, "--out", "a report folder", a.overwrite)?;
    }
    let out_dir = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!("reports/compare-{}", distgpt::metrics::unix_now()))
    });
    if a.task == CompareTask::Classify {
        return run_classify(a, out_dir, threads);
    }
    once_each("--models", a.models.as_deref().unwrap_or_default())?;
    for (given, flag) in [
        (a.init_from.is_some(), "--init-from"),
        (a.train_examples.is_some(), "--train-examples"),
    ] {
        if given {
            bail!("{flag} is for --task classify");
        }
    }
    let seq_len = a.seq_len.unwrap_or(64);
    let epochs = if a.quick {
        4.0
    } else {
        a.epochs.unwrap_or(1.0)
    };
    if a.quick {
        a.world_sizes = vec![2, 4];
        a.batch_sizes = vec![8, 16];
        a.steps = None;
        a.train_tokens = Some(a.train_tokens.unwrap_or(8_192));
    }
    if !(epochs > 0.0 && epochs.is_finite()) {
        bail!("--epochs must be a positive number, got {epochs}");
    }
    let mut ds = Dataset::load(
        a.data.as_deref(),
        a.tokenizer.unwrap_or(TokenizerKind::Char),
    )?;
    if let Some(n) = a.train_tokens {
        if n < seq_len + 1 {
            bail!(
                "--train-tokens {n} is shorter than one sequence of {} tokens",
                seq_len + 1
            );
        }
        ds.train = ds.train.head(n);
    }
    let names = a.models.as_deref().unwrap_or(&[]);
    let models = lm_models(names, ds.tokenizer.vocab_size(), seq_len)?;
    let repeats = a
        .repeats
        .map_or(if a.quick { 3 } else { 1 }, |n| n as usize);
    let spec = CompareSpec {
        models,
        layouts: a.strategies.clone(),
        world_sizes: a.world_sizes.clone(),
        batch_sizes: a.batch_sizes.clone(),
        seq_len,
        grad_accum: a.grad_accum as usize,
        duration: a.steps.map_or(Duration::Epochs(epochs), Duration::Steps),
        lr: a.lr.unwrap_or(3e-3),
        seed: a.seed,
        eval_batches: a.eval_batches.unwrap_or(8),
        out_dir,
        threads,
        predict: !a.no_predict,
        repeats,
        // a sign of life before minutes of training, --quick too
        announce_estimate: true,
    };
    compare::check(&spec)?;
    create_report_dir(&spec.out_dir)?;
    super::training::handle_stop_signals()?;
    let multi = MultiProgress::new();
    let done = compare::run(&spec, &ds, &multi)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let files = compare::report::write(&spec, &done, &command)?;
    let (header, rows) = lm_table(&done.results);
    let stopped = done.stopped.then_some((done.planned_cells, "cells"));
    finish(&header, &rows, &spec.out_dir, files.len(), stopped)
}

/// The language-model matrix's table: a row a run.
fn lm_table(results: &[compare::RunResult]) -> ([&'static str; 7], Vec<Vec<String>>) {
    let rows = results
        .iter()
        .map(|r| {
            vec![
                format!("{} {}", r.model, r.label),
                r.batch.to_string(),
                format!("{:.0}", r.tokens_per_s),
                format!("{:.2}", r.max_peak().total as f64 / distgpt::metrics::MIB),
                format!("{:.1}", r.time_per_epoch_s),
                format!("{:.4}", r.val_loss),
                r.max_loss_deviation_from_single
                    .map_or("-".into(), |d| format!("{d:.1e}")),
            ]
        })
        .collect();
    let header = [
        "strategy",
        "batch",
        "tokens/s",
        "peak MiB/rank",
        "epoch time s",
        "val loss",
        "dev vs single",
    ];
    (header, rows)
}

/// A matrix's close: its table, and where its report is, or (`stopped`:
/// the rows planned and what they are) that it stopped short.
fn finish(
    header: &[&str],
    rows: &[Vec<String>],
    out_dir: &Path,
    files: usize,
    stopped: Option<(usize, &str)>,
) -> Result<()> {
    for line in distgpt::metrics::table(header, rows, &[0]) {
        distgpt::outln!("{line}");
    }
    let report = out_dir.join("report.md");
    if let Some((planned, what)) = stopped {
        bail!(
            "stopped after {} of {planned} {what}: partial report in {}",
            rows.len(),
            report.display()
        );
    }
    distgpt::outln!("report: {} ({files} files)", report.display());
    Ok(())
}

/// Refuses a list that names a value twice: its cells would run twice
/// under one name, as if they were others.
fn once_each<T: PartialEq + std::fmt::Display>(flag: &str, values: &[T]) -> Result<()> {
    if values.iter().any(|v| v.to_string().is_empty()) {
        bail!("{flag} holds an empty name: a comma too many?");
    }
    match values.iter().enumerate().find(|(i, v)| values[..*i].contains(v)) {
        Some((_, v)) => bail!(
            "{flag} names {v} twice: name each value once (with --task lm, --repeats runs each cell more than once)"
        ),
        None => Ok(()),
    }
}

/// The language-model matrix's models: each preset (default
/// shakespeare-char-small) with the data's vocabulary, a causal one whose
/// block holds `seq_len` tokens.
fn lm_models(names: &[String], vocab: usize, seq_len: usize) -> Result<Vec<(String, ModelConfig)>> {
    let default = ["shakespeare-char-small".to_string()];
    let names = if names.is_empty() {
        &default[..]
    } else {
        names
    };
    let vocab = Reshape {
        vocab_size: Some(vocab),
        ..Reshape::default()
    };
    let mut models = Vec::new();
    for name in names {
        let m = ModelConfig::preset(name)?.reshaped(&vocab)?;
        m.validate()?;
        if !m.registration().causal {
            bail!("{name} is a {}: compare's language-model matrix trains causal language models; --task classify compares BERT fine-tuning", m.family());
        }
        if seq_len == 0 || seq_len > m.block_size() {
            bail!(
                "--seq-len {seq_len} must be between 1 and {name}'s block size {}",
                m.block_size()
            );
        }
        models.push((name.clone(), m));
    }
    Ok(models)
}

fn create_report_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the report directory {}", dir.display()))
}

/// `compare --task classify`: the fine-tuning matrix.
fn run_classify(a: CompareArgs, out_dir: PathBuf, threads: usize) -> Result<()> {
    for (given, flag) in [
        (a.models.is_some(), "--models"),
        (a.steps.is_some(), "--steps"),
        (a.train_tokens.is_some(), "--train-tokens"),
        (a.tokenizer.is_some(), "--tokenizer"),
        (a.eval_batches.is_some(), "--eval-batches"),
        (a.repeats.is_some(), "--repeats"),
    ] {
        if given {
            bail!("{flag} is for --task lm (fine-tuning reads the folder's WordPiece vocabulary and scores whole splits)");
        }
    }
    let (Some(init_from), Some(data)) = (a.init_from.clone(), a.data.clone()) else {
        bail!("--task classify needs --init-from (a Hugging Face BERT folder, e.g. all-MiniLM-L6-v2's) and --data (a labelled set)");
    };
    let (world_sizes, batch_sizes, train_examples, epochs) = if a.quick {
        (
            vec![2, 4],
            vec![8, 16],
            Some(a.train_examples.unwrap_or(256)),
            2.0,
        )
    } else {
        (
            a.world_sizes.clone(),
            a.batch_sizes.clone(),
            a.train_examples,
            a.epochs.unwrap_or(2.0),
        )
    };
    if !(epochs >= 1.0 && epochs.fract() == 0.0) {
        bail!("--epochs {epochs}: --task classify trains whole epochs");
    }
    create_report_dir(&out_dir)?;
    let seq_len = a
        .seq_len
        .unwrap_or_else(|| distgpt::train::classify::default_seq_len(&init_from));
    let task = ClassifyTask::new(&init_from, &data, train_examples, seq_len, a.seed)?
        .for_a_new_run(&init_from, a.seed);
    let mut base = TrainConfig {
        seq_len,
        duration: Duration::Epochs(epochs),
        grad_clip: 1.0,
        seed: a.seed,
        init_from: Some(init_from),
        data: Some(data),
        train_examples,
        ..TrainConfig::default()
    };
    // `train --task classify`'s defaults (its lr, AdamW, validation at
    // every epoch's end only), the lr when --lr is not given
    TaskKind::Classify
        .spec()
        .apply_defaults(&mut base, |f| match f {
            "lr" => a.lr.is_some(),
            "steps" | "epochs" => true,
            _ => false,
        });
    if let Some(lr) = a.lr {
        (base.lr, base.min_lr) = (lr, lr / 10.0);
    }
    let matrix = ClassifyMatrix {
        task,
        base,
        layouts: a.strategies.clone(),
        world_sizes,
        batch_sizes,
        out_dir,
        threads,
    };
    super::training::handle_stop_signals()?;
    let done = classify_matrix::run(&matrix, &MultiProgress::new())?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let files = classify_matrix::write(&matrix, &done, &command)?;
    let (header, rows) = classify_table(&done.rows);
    let stopped = done.stopped.then_some((done.planned_cells, "runs"));
    finish(&header, &rows, &matrix.out_dir, files.len(), stopped)
}

/// The fine-tuning matrix's table: a row a run.
fn classify_table(rows: &[ClassifyRow]) -> ([&'static str; 8], Vec<Vec<String>>) {
    let rows = rows
        .iter()
        .map(|r| {
            let accs: Vec<String> = r
                .epochs
                .iter()
                .map(|e| format!("{:.1}%", 100.0 * e.val.accuracy))
                .collect();
            vec![
                r.label.clone(),
                r.batch.to_string(),
                format!("{:.0}", r.tokens_per_s),
                format!(
                    "{:.1}",
                    distgpt::backend::PeakRow::largest(&r.rank_peak_bytes).total as f64
                        / distgpt::metrics::MIB
                ),
                format!("{:.1}", r.time_per_epoch_s),
                accs.join(" "),
                format!("{:.2}%", 100.0 * r.test.accuracy),
                r.max_loss_deviation_from_single
                    .map_or("-".into(), |d| format!("{d:.1e}")),
            ]
        })
        .collect();
    let header = [
        "layout",
        "batch",
        "tokens/s",
        "peak MiB/rank",
        "epoch time s",
        "val accuracy by epoch",
        "test acc",
        "dev vs single",
    ];
    (header, rows)
}
