//! The compare report's figures: throughput, step time and memory against
//! batch size, per-epoch time, memory and gradient norm, and loss curves,
//! drawn by [`crate::figure`].

use super::{RunResult, Spread};
pub use crate::figure::{write, Figure, Series};
use crate::metrics::MIB;

/// Series of `value`'s median against batch size, one per layout label,
/// with its min-max range when `value` varies over repeats.
fn by_batch(runs: &[&RunResult], value: impl Fn(&RunResult) -> Spread) -> Vec<Series> {
    series_by_batch(runs.iter().map(|r| (r.label.as_str(), r.batch, value(r))))
}

/// Series from (layout label, batch, value) points, one per label, in batch
/// order; ranges only where some point has a spread.
pub fn series_by_batch<'a>(
    points: impl IntoIterator<Item = (&'a str, usize, Spread)>,
) -> Vec<Series> {
    let mut sorted: Vec<(&str, usize, Spread)> = points.into_iter().collect();
    sorted.sort_by_key(|p| p.1);
    let mut out: Vec<Series> = Vec::new();
    for (label, batch, v) in sorted {
        let (p, range) = ((batch as f64, v.median), (v.min, v.max));
        match out.iter_mut().find(|s| s.label == label) {
            Some(s) => {
                s.points.push(p);
                s.ranges.push(range);
            }
            None => out.push(Series {
                label: label.to_string(),
                points: vec![p],
                ranges: vec![range],
            }),
        }
    }
    for s in &mut out {
        if s.ranges.iter().all(|(lo, hi)| lo == hi) {
            s.ranges.clear();
        }
    }
    out
}

/// Series of a per-epoch value, one per run.
fn by_epoch(runs: &[&RunResult], value: impl Fn(&super::EpochPoint) -> f64) -> Vec<Series> {
    runs.iter()
        .map(|r| {
            let points = r.per_epoch.iter().map(|p| (p.epoch as f64, value(p)));
            Series::new(r.label.clone(), points.collect())
        })
        .collect()
}

/// The seven figures of one model's runs; `suffix` tells models apart.
/// `reference_batch` picks the runs of the per-epoch figures and the loss curves.
pub fn figures(runs: &[&RunResult], suffix: &str, reference_batch: usize) -> Vec<Figure> {
    let model = runs.first().map_or("", |r| r.model.as_str());
    let at_ref: Vec<&RunResult> = runs
        .iter()
        .copied()
        .filter(|r| r.batch == reference_batch)
        .collect();
    let dev = at_ref
        .iter()
        .filter_map(|r| r.max_loss_deviation_from_single)
        .fold(0.0, f64::max);
    let seq = runs.first().map_or(0, |r| r.seq_len);
    let reps = runs.iter().map(|r| r.repeats.len()).max().unwrap_or(1);
    let median = if reps > 1 {
        format!(" (median of {reps} repeats, bars min-max)")
    } else {
        String::new()
    };
    vec![
        Figure::lines(
            format!("throughput_vs_batch{suffix}"),
            format!("{model}: training throughput{median}"),
            &format!("global batch (sequences of {seq} tokens)"),
            "throughput (tokens/s, all ranks)",
            by_batch(runs, |r| r.tokens_per_s_spread()),
            true,
            true,
        ),
        Figure::lines(
            format!("step_time_vs_batch{suffix}"),
            format!("{model}: time per optimizer step{median}"),
            &format!("global batch (sequences of {seq} tokens)"),
            "step time (ms)",
            by_batch(runs, |r| r.step_ms_spread()),
            true,
            true,
        ),
        Figure::lines(
            format!("memory_vs_batch{suffix}"),
            format!("{model}: peak memory of the largest rank"),
            &format!("global batch (sequences of {seq} tokens)"),
            "peak memory per rank (MiB)",
            by_batch(runs, |r| Spread::exact(r.max_peak().total as f64 / MIB)),
            true,
            true,
        ),
        Figure::lines(
            format!("time_per_epoch{suffix}"),
            format!("{model}: training time per epoch (batch {reference_batch})"),
            "epoch",
            "time (s, optimizer steps only; a partial epoch at its pace)",
            by_epoch(&at_ref, |p| p.time_per_epoch()),
            true,
            true,
        ),
        Figure::lines(
            format!("memory_per_epoch{suffix}"),
            format!("{model}: peak memory per rank by epoch (batch {reference_batch})"),
            "epoch",
            "peak memory per rank (MiB)",
            by_epoch(&at_ref, |p| p.peak_bytes as f64 / MIB),
            true,
            true,
        ),
        Figure::lines(
            format!("grad_norm_per_epoch{suffix}"),
            format!("{model}: mean gradient norm per epoch (batch {reference_batch})"),
            "epoch",
            "global gradient norm (before clipping)",
            by_epoch(&at_ref, |p| p.mean_grad_norm),
            true,
            false,
        ),
        Figure::lines(
            format!("loss_curves{suffix}"),
            format!(
                "{model}: training loss, batch {reference_batch} (max |dev| from single {dev:.1e})"
            ),
            "optimizer step",
            "training loss (nats/token)",
            at_ref
                .iter()
                .map(|r| loss_series(&r.label, &r.losses))
                .collect(),
            false,
            false,
        ),
    ]
}

/// A run's training loss against the optimizer step (from 1).
pub fn loss_series(label: &str, losses: &[f32]) -> Series {
    let points = losses
        .iter()
        .enumerate()
        .map(|(i, &l)| ((i + 1) as f64, l as f64));
    Series::new(label, points.collect())
}
