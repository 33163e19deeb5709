//! The report directory: results.json, results.csv, report.md and the figures.

use super::figures::{self, Figure};
use super::{CompareSpec, RunResult};
use crate::checkpoint::write_atomic;
use crate::error::Result;
use crate::plan::calibrate::Calibration;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

const CSV_HEADER: &str = "model,params,strategy,world_size,tp,batch,seq_len,steps,epochs,step_ms,tokens_per_s,tokens_per_s_per_rank,time_per_epoch_s,\
peak_params_bytes,peak_grads_bytes,peak_optimizer_bytes,peak_activations_bytes,peak_other_bytes,peak_total_bytes,\
final_loss,val_loss,final_grad_norm,comm_bytes_per_step,comm_ms_per_step,max_loss_deviation_from_single,predicted_peak_bytes,predicted_step_ms";

fn csv(results: &[RunResult]) -> String {
    let mut s = String::from(CSV_HEADER);
    s.push('\n');
    let opt = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x:.6e}"));
    for r in results {
        let p = r.max_peak();
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{:.4},{:.3},{:.1},{:.1},{:.3},{},{},{},{},{},{},{:.6},{:.6},{:.6},{:.0},{:.3},{},{},{}",
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
            p[0],
            p[1],
            p[2],
            p[3],
            p[4],
            p[5],
            r.final_loss,
            r.val_loss,
            r.final_grad_norm,
            r.comm_bytes_per_step,
            r.comm_ms_per_step,
            opt(r.max_loss_deviation_from_single),
            opt(r.predicted.as_ref().map(|p| p.peak_bytes)),
            opt(r.predicted.as_ref().map(|p| p.step_ms)),
        );
    }
    s
}

/// Predicted over measured, as a signed percentage.
fn off(pred: f64, measured: f64) -> String {
    format!("{:+.0}%", 100.0 * (pred - measured) / measured)
}

fn markdown(
    spec: &CompareSpec,
    results: &[RunResult],
    calibrations: &[Calibration],
    figure_files: &[(String, String)],
    command: &str,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# distgpt compare\n");
    let _ = writeln!(md, "`{command}`\n");
    let _ = writeln!(
        md,
        "{} runs on this machine ({} threads, thread ranks), sequence length {}, learning rate {}, seed {}; every run starts from the same weights and reads the same batches.\n",
        results.len(),
        spec.threads,
        spec.seq_len,
        spec.lr,
        spec.seed
    );
    let dev = results
        .iter()
        .filter(|r| r.strategy != crate::parallel::StrategyKind::Single)
        .filter_map(|r| r.max_loss_deviation_from_single)
        .fold(0.0, f64::max);
    let _ = writeln!(
        md,
        "**Equivalence:** the largest deviation of any run's per-step training loss from `single` at the same model and batch is **{dev:.2e}** (float summation order; the strategies compute the same step).\n"
    );
    let _ = writeln!(md, "## Results\n");
    let _ = writeln!(md, "| model | strategy | batch | tokens/s | tokens/s per rank | peak GiB per rank | time per epoch (s) | final loss | val loss | grad norm | comm MiB/step | comm ms/step | max dev from single |");
    let _ = writeln!(
        md,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in results {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} | {:.0} | {:.4} | {:.1} | {:.4} | {:.4} | {:.3} | {:.2} | {:.1} | {} |",
            r.model,
            r.label,
            r.batch,
            r.tokens_per_s,
            r.tokens_per_s_per_rank,
            r.max_peak()[5] as f64 / GIB,
            r.time_per_epoch_s,
            r.final_loss,
            r.val_loss,
            r.final_grad_norm,
            r.comm_bytes_per_step / (1024.0 * 1024.0),
            r.comm_ms_per_step,
            r.max_loss_deviation_from_single
                .map_or("-".into(), |d| format!("{d:.1e}"))
        );
    }
    if results.iter().any(|r| r.predicted.is_some()) {
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
                "- {} params, global batch {} x {} on {} rank(s): {:.0}%",
                c.model.num_params(),
                c.batch,
                c.seq_len,
                c.ranks,
                100.0 * c.efficiency
            );
        }
        let _ = writeln!(md, "\n| model | strategy | batch | peak MiB measured | predicted | off | step ms measured | predicted | off |");
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in results {
            if let Some(p) = &r.predicted {
                let peak = r.max_peak()[5] as f64;
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.2} | {:.2} | {} | {:.1} | {:.1} | {} |",
                    r.model,
                    r.label,
                    r.batch,
                    peak / 1048576.0,
                    p.peak_bytes / 1048576.0,
                    off(p.peak_bytes, peak),
                    r.step_ms,
                    p.step_ms,
                    off(p.step_ms, r.step_ms)
                );
            }
        }
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
pub fn write(
    spec: &CompareSpec,
    results: &[RunResult],
    calibrations: &[Calibration],
    command: &str,
) -> Result<Vec<PathBuf>> {
    let dir: &Path = &spec.out_dir;
    let mut written = Vec::new();
    let json = serde_json::to_string_pretty(results).expect("results serialise");
    write_atomic(&dir.join("results.json"), json.as_bytes())?;
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
    let md = markdown(spec, results, calibrations, &figure_files, command);
    write_atomic(&dir.join("report.md"), md.as_bytes())?;
    written.push(dir.join("report.md"));
    Ok(written)
}
