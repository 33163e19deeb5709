//! The report directory: results.json, results.csv, report.md and the figures.

use super::figures::{self, Figure};
use super::{CompareSpec, Comparison, RunResult, Spread};
use crate::backend::PeakRow;
use crate::error::Result;
use crate::metrics::MIB;
use crate::parallel::StrategyKind;
use crate::store::{write_atomic, write_json};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The columns before the peak's ([`PeakRow::CSV_HEADER`]) and after.
const CSV_HEADER: [&str; 2] = [
    "model,params,strategy,world_size,tp,batch,seq_len,steps,epochs,step_ms,tokens_per_s,tokens_per_s_per_rank,time_per_epoch_s,\
repeats,tokens_per_s_min,tokens_per_s_max",
    "final_loss,val_loss,final_grad_norm,comm_bytes_per_step,comm_ms_per_step,max_loss_deviation_from_single,predicted_peak_bytes,predicted_step_ms,layout",
];

fn csv(results: &[RunResult]) -> String {
    let [head, tail] = CSV_HEADER;
    let mut s = format!("{head},{},{tail}\n", PeakRow::CSV_HEADER);
    let opt = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x:.6e}"));
    for r in results {
        let p = r.max_peak();
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{:.4},{:.3},{:.1},{:.1},{:.3},{},{:.1},{:.1},{},{:.6},{:.6},{:.6},{:.0},{:.3},{},{},{},{}",
            r.model,
            r.params,
            r.strategy,
            r.world_size,
            r.tp,
            r.batch,
            r.seq_len,
            r.steps,
            r.epochs,
            r.step_ms,
            r.tokens_per_s,
            r.tokens_per_s_per_rank,
            r.time_per_epoch_s,
            r.repeats.len(),
            r.tokens_per_s_spread().min,
            r.tokens_per_s_spread().max,
            p.csv(),
            r.final_loss,
            r.val_loss,
            r.final_grad_norm,
            r.comm_bytes_per_step,
            r.comm_ms_per_step,
            opt(r.max_loss_deviation_from_single),
            opt(r.predicted.as_ref().map(|p| p.peak_bytes)),
            opt(r.predicted.as_ref().map(|p| p.step_ms)),
            // what tells a pipeline's rows from ddp's ("ddp x2 (pp 2 gpipe)")
            r.label.replace(',', ";"),
        );
    }
    s
}

/// Predicted over measured, as a signed percentage.
fn off(pred: f64, measured: f64) -> String {
    format!("{:+.0}%", 100.0 * (pred - measured) / measured)
}

/// True when `plan`'s predicted peak is within 0.5% of the measured one on every predicted run.
fn memory_prediction_exact(results: &[RunResult]) -> bool {
    results.iter().all(|r| {
        r.predicted.as_ref().is_none_or(|p| {
            let m = r.max_peak().total as f64;
            (p.peak_bytes - m).abs() <= 0.005 * m
        })
    })
}

/// The opening bullets: fastest layout, smallest memory, equivalence and
/// how much of a difference is noise.
fn summary(done: &Comparison) -> String {
    let results = &done.results;
    let mut md = String::from("## Summary\n\n");
    if done.stopped {
        let _ = writeln!(
            md,
            "- **Partial report:** stopped by a signal after {} of {} cells; the rest did not run.",
            results.len(),
            done.planned_cells
        );
    }
    let reps = results.iter().map(|r| r.repeats.len()).max().unwrap_or(0);
    let median_of = if reps > 1 {
        format!("median of {reps} repeats")
    } else {
        "one run".into()
    };
    if let Some(r) = results
        .iter()
        .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s))
    {
        let _ = writeln!(
            md,
            "- **Fastest:** {} {} at batch {}: {:.0} tokens/s ({median_of}).",
            r.model, r.label, r.batch, r.tokens_per_s
        );
    }
    if let Some(r) = results.iter().min_by_key(|r| r.max_peak().total) {
        let _ = writeln!(
            md,
            "- **Smallest peak memory per rank:** {} {} at batch {}: {:.2} MiB.",
            r.model,
            r.label,
            r.batch,
            r.max_peak().total as f64 / MIB
        );
    }
    let devs: Vec<f64> = results
        .iter()
        .filter(|r| r.strategy != StrategyKind::Single)
        .filter_map(|r| r.max_loss_deviation_from_single)
        .collect();
    if devs.is_empty() {
        let _ = writeln!(md, "- **Equivalence:** not measured (no `single` run beside a parallel one at the same model and batch).");
    } else {
        let _ = writeln!(
            md,
            "- **Equivalence:** the largest difference of any run's per-step training loss from `single` at the same model and batch is **{:.2e}** (float summation order; the strategies compute the same step).",
            devs.iter().copied().fold(0.0, f64::max)
        );
    }
    let spreads: Vec<(f64, &RunResult)> = results
        .iter()
        .filter(|r| r.repeats.len() > 1)
        .map(|r| (r.tokens_per_s_spread().range_percent(), r))
        .collect();
    match spreads.iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
        Some((worst, r)) => {
            let typical = Spread::of(spreads.iter().map(|s| s.0)).median;
            let _ = writeln!(
                md,
                "- **Noise:** the repeats of a cell spread by {typical:.1}% in tokens/s (max - min over median; median over cells), up to {worst:.1}% ({} batch {}): smaller differences between layouts are noise.",
                r.label, r.batch
            );
        }
        None => {
            let _ = writeln!(md, "- **Noise:** each cell ran once, so the spread of step times is unknown; rerun with `--repeats 3` before trusting differences of a few percent.");
        }
    }
    md
}

/// The report's section comparing `plan`'s predictions with the runs.
fn predictions(
    results: &[RunResult],
    calibrations: &[crate::plan::calibrate::Calibration],
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "\n## `plan`'s predictions against these runs\n");
    if let Some(m) = calibrations.first().map(|c| &c.machine) {
        let _ = writeln!(
            md,
            "This machine, measured before the runs: matmul peak {:.0} GFLOP/s, AdamW {:.1} GB/s, thread-rank all-reduce {:.1} GB/s + {:.0} us. \
             Step efficiency, measured on one rank with its share of threads and batch:\n",
            m.peak_flops / 1e9,
            m.memory_bandwidth / 1e9,
            m.comm_bandwidth / 1e9,
            m.comm_latency_s * 1e6
        );
    }
    for c in calibrations {
        let _ = writeln!(
            md,
            "- {} params, global batch {} x {} on {}: {:.0}% (timed on {} params at {} x {} tokens a rank)",
            c.model.num_params(),
            c.batch,
            c.seq_len,
            crate::metrics::count(c.ranks, "rank"),
            100.0 * c.efficiency,
            c.measured.0.num_params(),
            c.measured.1,
            c.measured.2
        );
    }
    let exact = memory_prediction_exact(results);
    if exact {
        let _ = writeln!(md, "\nPeak memory: the prediction is within 0.5% of the measured peak on every run, so only step times are compared.");
        let _ = writeln!(
            md,
            "\n| model | strategy | batch | step ms measured (median) | predicted | error |"
        );
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|");
    } else {
        let _ = writeln!(md, "\n| model | strategy | batch | peak MiB measured | predicted | error | step ms measured (median) | predicted | error |");
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    }
    for r in results {
        if let Some(p) = &r.predicted {
            let peak = r.max_peak().total as f64;
            let memory = if exact {
                String::new()
            } else {
                format!(
                    " {:.2} | {:.2} | {} |",
                    peak / MIB,
                    p.peak_bytes / MIB,
                    off(p.peak_bytes, peak)
                )
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} |{memory} {:.1} | {:.1} | {} |",
                r.model,
                r.label,
                r.batch,
                r.step_ms,
                p.step_ms,
                off(p.step_ms, r.step_ms)
            );
        }
    }
    md
}

fn markdown(
    spec: &CompareSpec,
    done: &Comparison,
    figure_files: &[(String, String)],
    command: &str,
) -> String {
    let (results, calibrations) = (&done.results, &done.calibrations);
    let mut md = String::new();
    let _ = writeln!(md, "# distgpt compare\n");
    md.push_str(&summary(done));
    let _ = writeln!(md, "\n`{command}`\n");
    let _ = writeln!(
        md,
        "{} cells on this machine ({} threads, thread ranks), each run {} time(s), sequence length {}, learning rate {}, seed {}; every run starts from the same weights and reads the same batches. Memory is in MiB (2^20 bytes) throughout.\n",
        results.len(),
        spec.threads,
        spec.repeats,
        spec.seq_len,
        spec.lr,
        spec.seed
    );
    let _ = writeln!(md, "## Results\n");
    let _ = writeln!(md, "| model | strategy | batch | tokens/s (median) | min - max | tokens/s per rank | peak MiB per rank | time per epoch (s) | final loss | val loss | grad norm | comm MiB/step | comm ms/step | max dev from single |");
    let _ = writeln!(
        md,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in results {
        let t = r.tokens_per_s_spread();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} | {:.0} - {:.0} | {:.0} | {:.2} | {:.1} | {:.4} | {:.4} | {:.3} | {:.2} | {:.1} | {} |",
            r.model,
            r.label,
            r.batch,
            r.tokens_per_s,
            t.min,
            t.max,
            r.tokens_per_s_per_rank,
            r.max_peak().total as f64 / MIB,
            r.time_per_epoch_s,
            r.final_loss,
            r.val_loss,
            r.final_grad_norm,
            r.comm_bytes_per_step / MIB,
            r.comm_ms_per_step,
            r.max_loss_deviation_from_single
                .map_or("-".into(), |d| format!("{d:.1e}"))
        );
    }
    let mut strategies: Vec<StrategyKind> = Vec::new();
    for r in results {
        if !strategies.contains(&r.strategy) {
            strategies.push(r.strategy);
        }
    }
    for what in strategies.iter().filter_map(|s| s.other_memory()) {
        let _ = writeln!(md, "\nMemory: {what}.");
    }
    if results.iter().any(|r| r.predicted.is_some()) {
        md.push_str(&predictions(results, calibrations));
    }
    let _ = writeln!(md, "\n## Figures\n");
    for (title, file) in figure_files {
        let _ = writeln!(md, "### {title}\n\n![{title}]({file})\n");
    }
    let _ = writeln!(
        md,
        "Per-run metrics (every step, every rank's peak memory) are in `runs/*/metrics.jsonl`."
    );
    md
}

/// Writes everything into `spec.out_dir`; returns the files written.
pub fn write(spec: &CompareSpec, done: &Comparison, command: &str) -> Result<Vec<PathBuf>> {
    let results = &done.results;
    let dir: &Path = &spec.out_dir;
    let mut written = Vec::new();
    write_json(&dir.join("results.json"), results)?;
    write_atomic(&dir.join("results.csv"), csv(results).as_bytes())?;
    written.push(dir.join("results.json"));
    written.push(dir.join("results.csv"));
    let mut figure_files = Vec::new();
    let models: Vec<&str> = spec.models.iter().map(|(n, _)| n.as_str()).collect();
    let reference_batch = spec.batch_sizes.iter().copied().min().unwrap_or(1);
    for model in &models {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.model == *model).collect();
        let suffix = if models.len() > 1 {
            format!("-{model}")
        } else {
            String::new()
        };
        let figs: Vec<Figure> = figures::figures(&runs, &suffix, reference_batch);
        for f in &figs {
            written.extend(figures::write(dir, f)?);
            figure_files.push((f.title.clone(), format!("{}.png", f.stem)));
        }
    }
    // each pipeline run's last step, rank by rank
    for r in results.iter().filter(|r| !r.timelines.is_empty()) {
        let grid = crate::parallel::Grid {
            dp: r.world_size / (r.tp.max(1) * r.pipeline.stages.max(1)),
            pp: r.pipeline.stages.max(1),
            tp: r.tp.max(1),
        };
        let tl = crate::figure::Timeline::of_ranks(
            format!(
                "timeline-{}-{}-x{}-{}-b{}",
                r.model,
                r.strategy,
                r.world_size,
                r.pipeline.to_string().replace(' ', "-"),
                r.batch
            ),
            format!(
                "{} {}, batch {}: bubble {:.1}% measured, {:.1}% by formula",
                r.model,
                r.label,
                r.batch,
                100.0 * r.bubble.unwrap_or(f64::NAN),
                100.0 * r.bubble_formula.unwrap_or(f64::NAN)
            ),
            &grid,
            &r.timelines,
        );
        written.extend(crate::figure::write_timeline(dir, &tl)?);
        figure_files.push((tl.title.clone(), format!("{}.png", tl.stem)));
    }
    let md = markdown(spec, done, &figure_files, command);
    write_atomic(&dir.join("report.md"), md.as_bytes())?;
    written.push(dir.join("report.md"));
    Ok(written)
}
