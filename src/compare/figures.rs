//! The report's figures as PNG and SVG (plotters), text in the bundled
//! DejaVu Sans so they look the same on every machine. The legend sits in
//! its own panel right of the plot, so it never covers a curve.

use super::RunResult;
use crate::error::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Once;

const FONT: &str = "sans-serif";
const WIDTH: u32 = 1100;
const HEIGHT: u32 = 620;
const LEGEND_WIDTH: u32 = 250;

/// Plotters looks fonts up by family; ours is compiled in.
fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let bytes = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
        if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_err() {
            unreachable!("the bundled DejaVu Sans parses");
        }
    });
}

/// One line of a figure.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart over whole-number x values (batch sizes, epochs, steps).
pub struct Figure {
    /// File name without extension.
    pub stem: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Draw a marker on every point (sparse data), not only the line.
    pub markers: bool,
    /// Start the y axis at zero.
    pub y_from_zero: bool,
}

fn padded_range(lo: f64, hi: f64, from_zero: bool) -> (f64, f64) {
    let lo = if from_zero { 0.0 } else { lo };
    let span = (hi - lo).abs().max(hi.abs() * 1e-3).max(1e-9);
    (
        if from_zero { 0.0 } else { lo - 0.05 * span },
        hi + 0.08 * span,
    )
}

/// Distinct on white, none pale: Tableau's ten, then black and navy.
const COLORS: [RGBColor; 12] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(0, 0, 128),
];

/// A number for an axis label, short enough not to collide: 12k, 1.5M,
/// 0.25, 3.5; empty for the fractional ticks of a whole-number axis.
fn tick(v: f64, whole: bool) -> String {
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    let a = v.abs();
    if whole && (v - v.round()).abs() > 1e-9 {
        String::new()
    } else if a >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if a >= 1e3 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else if a >= 1.0 || a == 0.0 {
        trim(format!("{v:.2}"))
    } else {
        trim(format!("{v:.3}"))
    }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, fig: &Figure) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err =
        |e: DrawingAreaErrorKind<DB::ErrorType>| Error::Input(format!("drawing {}: {e}", fig.stem));
    root.fill(&WHITE).map_err(err)?;
    let (plot, legend) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    let pts = fig.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let (y0, y1) = padded_range(y0, y1, fig.y_from_zero);
    let xs = (x1 - x0).max(1.0);
    let mut chart = ChartBuilder::on(&plot)
        .caption(&fig.title, (FONT, 22))
        .margin(18)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(x0 - 0.04 * xs..x1 + 0.04 * xs, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(&fig.x_label)
        .y_desc(&fig.y_label)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .x_label_formatter(&|v| tick(*v, true))
        .y_label_formatter(&|v| tick(*v, false))
        .x_labels(8)
        .y_labels(8)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    legend.fill(&WHITE).map_err(err)?;
    for (i, s) in fig.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // the first series (single, the reference) is drawn widest, so curves
        // that coincide with it stay visible on top
        let width = if i == 0 { 6 } else { 2 };
        let line = color.stroke_width(width);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), line))
            .map_err(err)?;
        if fig.markers {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(err)?;
        }
        let y = 70 + 26 * i as i32;
        legend
            .draw(&PathElement::new(vec![(8, y), (40, y)], line))
            .map_err(err)?;
        legend
            .draw(&Text::new(s.label.clone(), (48, y - 9), (FONT, 15)))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Writes `dir/stem.png` and `dir/stem.svg`; returns both paths.
pub fn write(dir: &Path, fig: &Figure) -> Result<Vec<PathBuf>> {
    register_font();
    let png = dir.join(format!("{}.png", fig.stem));
    let svg = dir.join(format!("{}.svg", fig.stem));
    draw(
        BitMapBackend::new(&png, (WIDTH, HEIGHT)).into_drawing_area(),
        fig,
    )?;
    draw(
        SVGBackend::new(&svg, (WIDTH, HEIGHT)).into_drawing_area(),
        fig,
    )?;
    Ok(vec![png, svg])
}

/// Series of `value` against batch size, one per layout label.
fn by_batch(runs: &[&RunResult], value: impl Fn(&RunResult) -> f64) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in runs {
        let p = (r.batch as f64, value(r));
        match out.iter_mut().find(|s| s.label == r.label) {
            Some(s) => s.points.push(p),
            None => out.push(Series {
                label: r.label.clone(),
                points: vec![p],
            }),
        }
    }
    for s in &mut out {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Series of a per-epoch value, one per run.
fn by_epoch(runs: &[&RunResult], value: impl Fn(&super::EpochPoint) -> f64) -> Vec<Series> {
    runs.iter()
        .map(|r| Series {
            label: r.label.clone(),
            points: r
                .per_epoch
                .iter()
                .map(|p| (p.epoch as f64, value(p)))
                .collect(),
        })
        .collect()
}

const MIB: f64 = 1024.0 * 1024.0;

/// The six figures of one model's runs; `suffix` tells models apart.
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
    let fig = |stem: &str, title: String, x: &str, y: &str, series, markers, zero| Figure {
        stem: format!("{stem}{suffix}"),
        title,
        x_label: x.into(),
        y_label: y.into(),
        series,
        markers,
        y_from_zero: zero,
    };
    let seq = runs.first().map_or(0, |r| r.seq_len);
    vec![
        fig(
            "throughput_vs_batch",
            format!("{model}: training throughput"),
            &format!("global batch (sequences of {seq} tokens)"),
            "throughput (tokens/s, all ranks)",
            by_batch(runs, |r| r.tokens_per_s),
            true,
            true,
        ),
        fig(
            "memory_vs_batch",
            format!("{model}: peak memory of the largest rank"),
            &format!("global batch (sequences of {seq} tokens)"),
            "peak memory per rank (MiB)",
            by_batch(runs, |r| r.max_peak()[5] as f64 / MIB),
            true,
            true,
        ),
        fig(
            "time_per_epoch",
            format!("{model}: training time per epoch (batch {reference_batch})"),
            "epoch",
            "time (s, optimizer steps only)",
            by_epoch(&at_ref, |p| p.seconds),
            true,
            true,
        ),
        fig(
            "memory_per_epoch",
            format!("{model}: peak memory per rank by epoch (batch {reference_batch})"),
            "epoch",
            "peak memory per rank (MiB)",
            by_epoch(&at_ref, |p| p.peak_bytes as f64 / MIB),
            true,
            true,
        ),
        fig(
            "grad_norm_per_epoch",
            format!("{model}: mean gradient norm per epoch (batch {reference_batch})"),
            "epoch",
            "global gradient norm (before clipping)",
            by_epoch(&at_ref, |p| p.mean_grad_norm),
            true,
            false,
        ),
        fig(
            "loss_curves",
            format!(
                "{model}: training loss, batch {reference_batch} (max |dev| from single {dev:.1e})"
            ),
            "optimizer step",
            "training loss (nats/token)",
            at_ref
                .iter()
                .map(|r| Series {
                    label: r.label.clone(),
                    points: r
                        .losses
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| ((i + 1) as f64, l as f64))
                        .collect(),
                })
                .collect(),
            false,
            false,
        ),
    ]
}
