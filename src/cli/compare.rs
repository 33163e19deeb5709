//! `distgpt compare`: the strategy matrix in one command, with a report.

use anyhow::{bail, Context, Result};
use clap::Args;
use distgpt::compare::{self, CompareSpec, Layout};
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::train::Duration;
use indicatif::MultiProgress;
use std::path::PathBuf;

#[derive(Args)]
pub struct CompareArgs {
    /// A small matrix that finishes in a few minutes on 2 cores: every
    /// strategy on 2 and 4 ranks, batches 8 and 16, 4 epochs over 8k tokens.
    #[arg(long)]
    quick: bool,
    /// Model presets, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "shakespeare-char-small")]
    models: Vec<String>,
    /// Strategies, comma-separated (mesh: ddp over tensor-parallel pairs).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "single,ddp,zero1,zero2,fsdp,tp,mesh"
    )]
    strategies: Vec<Layout>,
    /// World sizes of the parallel strategies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    world_sizes: Vec<usize>,
    /// Global batches (sequences per micro-step, split across the data-parallel ranks), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32")]
    batch_sizes: Vec<usize>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Optimizer steps per run (instead of --epochs).
    #[arg(long, conflicts_with = "epochs")]
    steps: Option<usize>,
    /// Passes over the training split per run.
    #[arg(long, default_value_t = 1.0)]
    epochs: f64,
    /// Train on the first N tokens of the training split only (shorter epochs).
    #[arg(long)]
    train_tokens: Option<usize>,
    /// Training data: a text file or a directory of token shards (default: embedded Shakespeare).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokenizer for text data: char or gpt2 (BPE).
    #[arg(long, value_enum, default_value = "char")]
    tokenizer: TokenizerKind,
    /// Peak learning rate of every run (warmup 10 steps, cosine to lr / 10).
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Seed of the initial weights and the data order, the same for every run.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Validation batches at the end of each run.
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
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
}

pub fn run(mut a: CompareArgs, threads: usize) -> Result<()> {
    if a.quick {
        a.world_sizes = vec![2, 4];
        a.batch_sizes = vec![8, 16];
        a.steps = None;
        a.epochs = 4.0;
        a.train_tokens = Some(a.train_tokens.unwrap_or(8_192));
    }
    if a.batch_sizes.contains(&0) || a.world_sizes.contains(&0) {
        bail!("--batch-sizes and --world-sizes must be at least 1");
    }
    if !(a.epochs > 0.0 && a.epochs.is_finite()) {
        bail!("--epochs must be a positive number, got {}", a.epochs);
    }
    let mut ds = Dataset::load(a.data.as_deref(), a.tokenizer)?;
    if let Some(n) = a.train_tokens {
        if n < a.seq_len + 1 {
            bail!(
                "--train-tokens {n} is shorter than one sequence of {} tokens",
                a.seq_len + 1
            );
        }
        ds.train = ds.train.head(n);
    }
    let mut models = Vec::new();
    for name in &a.models {
        let mut m = GptConfig::preset(name)?;
        m.vocab_size = ds.tokenizer.vocab_size();
        m.validate()?;
        if a.seq_len == 0 || a.seq_len > m.block_size {
            bail!(
                "--seq-len {} must be between 1 and {name}'s block size {}",
                a.seq_len,
                m.block_size
            );
        }
        models.push((name.clone(), m));
    }
    let out_dir = a.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from(format!("reports/compare-{secs}"))
    });
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("creating the report directory {}", out_dir.display()))?;
    let repeats = a
        .repeats
        .map_or(if a.quick { 3 } else { 1 }, |n| n as usize);
    let spec = CompareSpec {
        models,
        layouts: a.strategies.clone(),
        world_sizes: a.world_sizes.clone(),
        batch_sizes: a.batch_sizes.clone(),
        seq_len: a.seq_len,
        duration: a.steps.map_or(Duration::Epochs(a.epochs), Duration::Steps),
        lr: a.lr,
        seed: a.seed,
        eval_batches: a.eval_batches,
        out_dir,
        threads,
        predict: !a.no_predict,
        repeats,
        announce_estimate: !a.quick,
    };
    super::handle_stop_signals()?;
    let multi = MultiProgress::new();
    let done = compare::run(&spec, &ds, &multi)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let files = compare::report::write(&spec, &done, &command)?;
    let results = &done.results;
    distgpt::outln!(
        "{:<22} {:>6} {:>11} {:>14} {:>14} {:>10} {:>14}",
        "strategy",
        "batch",
        "tokens/s",
        "peak MiB/rank",
        "epoch time s",
        "val loss",
        "dev vs single"
    );
    for r in results {
        distgpt::outln!(
            "{:<22} {:>6} {:>11.0} {:>14.2} {:>14.1} {:>10.4} {:>14}",
            format!("{} {}", r.model, r.label),
            r.batch,
            r.tokens_per_s,
            r.max_peak()[5] as f64 / 1048576.0,
            r.time_per_epoch_s,
            r.val_loss,
            r.max_loss_deviation_from_single
                .map_or("-".into(), |d| format!("{d:.1e}"))
        );
    }
    let report = spec.out_dir.join("report.md");
    if done.stopped {
        bail!(
            "stopped after {} of {} cells: partial report in {}",
            results.len(),
            done.planned_cells,
            report.display()
        );
    }
    distgpt::outln!("report: {} ({} files)", report.display(), files.len());
    Ok(())
}
