//! Line charts as PNG and SVG (plotters), for `compare`'s report and
//! `distgpt plot`, and pipeline timelines for `bench --timeline`; text in the bundled DejaVu Sans so they look the same on
//! every machine. The legend sits in its own panel right of the plot, so it
//! never covers a curve; below it, a note names the series that coincide
//! (and so hide one another). Series differ in colour, marker shape and dash
//! pattern, so a dozen stay apart.

use crate::error::{Error, Result};
use crate::parallel::pipeline::Pass;
use crate::parallel::Span;
use image::codecs::png::PngEncoder;
use image::{ColorType, ImageEncoder};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Once;

const FONT: &str = "sans-serif";
const WIDTH: u32 = 1100;
const HEIGHT: u32 = 620;
const LEGEND_WIDTH: u32 = 250;
/// Characters of a legend label per line: what fits right of its sample.
const LABEL_CHARS: usize = 22;
/// Points above which a curve is drawn in thinner lines.
const DENSE: usize = 200;

/// Plotters looks fonts up by family; ours is compiled in.
fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let bytes = include_bytes!("../assets/fonts/DejaVuSans.ttf");
        if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_err() {
            unreachable!("the bundled DejaVu Sans parses");
        }
    });
}

/// One line of a figure.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// The (min, max) over repeats of each point, drawn as a bar; empty
    /// when the points have no spread.
    pub ranges: Vec<(f64, f64)>,
}

/// A line chart over whole-number x values (batch sizes, epochs, steps),
/// ticked only where a point was measured (or, for dense x like steps, at
/// round numbers).
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
    /// Points only, no lines, on an x axis of any real values (ticked at
    /// round numbers): a scatter of what is not a curve. Its last series
    /// (a recommendation among the points) is ringed in black.
    pub scatter: bool,
}

impl Series {
    /// A series of `points` without ranges.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            label: label.into(),
            points,
            ranges: Vec::new(),
        }
    }
}

impl Figure {
    /// A line chart (not a scatter) of `series`, written as `stem`, with
    /// `markers` on every point and its y axis `y_from_zero` or not.
    pub fn lines(
        stem: impl Into<String>,
        title: impl Into<String>,
        x_label: &str,
        y_label: &str,
        series: Vec<Series>,
        markers: bool,
        y_from_zero: bool,
    ) -> Self {
        Figure {
            stem: stem.into(),
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series,
            markers,
            y_from_zero,
            scatter: false,
        }
    }
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

/// A number for an axis label, short enough not to collide (12k, 1.5M,
/// 0.25): with the fewest decimals that write it exactly (1.05k beside
/// 1.1k; a measured step, 1.563k), at most three more than tell ticks
/// `step` apart; empty for the fractional ticks of a whole-number axis.
fn tick(v: f64, whole: bool, step: f64) -> String {
    if whole && (v - v.round()).abs() > 1e-9 {
        return String::new();
    }
    let (scale, suffix) = match v.abs() {
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e3 => (1e3, "k"),
        _ => (1.0, ""),
    };
    let x = v / scale;
    let apart = (-(step / scale).log10() - 1e-9).ceil().clamp(0.0, 9.0) as usize;
    let exact = (0..9usize)
        .find(|&d| {
            let unit = 10f64.powi(d as i32);
            ((x * unit).round() / unit - x).abs() <= 1e-9 * x.abs().max(1.0)
        })
        .unwrap_or(9);
    let s = format!("{:.*}", exact.min(apart + 3).max(apart), x);
    let s = match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.'),
        false => &s,
    };
    format!("{s}{suffix}")
}

/// The gap between neighbouring `ticks`, the smallest (a lone tick's: its
/// own order of magnitude).
fn tick_step(ticks: &[f64]) -> f64 {
    let gaps = ticks.windows(2).map(|w| w[1] - w[0]).filter(|g| *g > 0.0);
    match gaps.min_by(f64::total_cmp) {
        Some(g) => g,
        None => ticks
            .first()
            .map_or(1.0, |v| 10f64.powf(v.abs().max(1e-9).log10().floor())),
    }
}

/// A round step (1, 2 or 5 times a power of ten) giving at most `n`
/// intervals over lo..hi.
fn round_step(lo: f64, hi: f64, n: f64) -> f64 {
    let rough = (hi - lo) / n;
    let mag = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= rough)
        .unwrap_or(10.0 * mag)
}

/// The multiples of `step` from lo to hi.
fn multiples(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    let first = (lo / step).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// An f64 axis with ticks and grid lines only at the given values (plotters'
/// own axes pick round numbers, which put ticks between measured batches).
struct TickedAxis {
    range: RangedCoordf64,
    ticks: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.range.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.max_num_points() == 0 {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.range.range()
    }
}

/// Up to this many distinct x values, every one gets a tick and no other does.
const MAX_MEASURED_TICKS: usize = 16;

/// The x ticks: the measured x values when there are few, else round
/// whole numbers (1, 2 or 5 x 10^k apart) over their range.
pub fn x_ticks(fig: &Figure) -> Vec<f64> {
    let mut xs: Vec<f64> = fig
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if xs.len() <= MAX_MEASURED_TICKS && !fig.scatter {
        return xs;
    }
    if xs.is_empty() {
        return xs;
    }
    let (lo, hi) = (xs[0], xs[xs.len() - 1]);
    let step = round_step(lo, hi, 8.0);
    // a whole-number axis never ticks between its values; a scatter's
    // single value gets the one tick
    let step = match fig.scatter {
        true if hi > lo => step,
        true => return xs,
        false => step.max(1.0),
    };
    multiples(lo, hi, step)
}

/// Groups (of two or more) of series indices whose points coincide: the
/// same x values and y within `tol` everywhere.
pub fn coincident(series: &[Series], tol: f64) -> Vec<Vec<usize>> {
    let same = |a: &Series, b: &Series| {
        a.points.len() == b.points.len()
            && a.points
                .iter()
                .zip(&b.points)
                .all(|(p, q)| p.0 == q.0 && (p.1 - q.1).abs() <= tol)
    };
    let mut taken = vec![false; series.len()];
    let mut groups = Vec::new();
    for i in 0..series.len() {
        if taken[i] {
            continue;
        }
        let group: Vec<usize> = (i..series.len())
            .filter(|&j| !taken[j] && same(&series[i], &series[j]))
            .collect();
        if group.len() > 1 {
            for &j in &group {
                taken[j] = true;
            }
            groups.push(group);
        }
    }
    groups
}

/// The notes under the legend: which series coincide (within a pixel, 0.2%
/// of the y span), since only the one drawn last shows.
pub fn notes(fig: &Figure, y_span: f64) -> Vec<String> {
    coincident(&fig.series, 0.002 * y_span)
        .iter()
        .map(|g| {
            let first = &fig.series[g[0]].label;
            if g.len() == fig.series.len() {
                format!("{} series coincide: all follow {first}", g.len())
            } else {
                let others: Vec<&str> = g[1..]
                    .iter()
                    .map(|&j| fig.series[j].label.as_str())
                    .collect();
                let verb = if others.len() == 1 {
                    "follows"
                } else {
                    "follow"
                };
                format!(
                    "{} series coincide: {} {verb} {first}",
                    g.len(),
                    others.join(", ")
                )
            }
        })
        .collect()
}

/// Splits `text` into lines of at most `width` characters at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = vec![String::new()];
    // a word wider than a line is cut into lines of its own, after a '-'
    // where one falls in the line (a run's name)
    let words = text.split(' ').flat_map(|w| {
        let mut parts = Vec::new();
        let mut rest: Vec<char> = w.chars().collect();
        while rest.len() > width {
            let cut = rest[..width]
                .iter()
                .rposition(|&c| c == '-')
                .map_or(width, |i| i + 1);
            parts.push(rest.drain(..cut).collect::<String>());
        }
        parts.push(rest.into_iter().collect());
        parts
    });
    for word in words {
        let line = lines.last_mut().expect("one line at least");
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(word);
        } else {
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(&word);
        }
    }
    lines
}

#[derive(Clone, Copy)]
enum Marker {
    Dot,
    Triangle,
    Square,
    Cross,
    Ring,
}

const MARKERS: [Marker; 5] = [
    Marker::Dot,
    Marker::Triangle,
    Marker::Square,
    Marker::Cross,
    Marker::Ring,
];

#[derive(Clone, Copy)]
enum Dash {
    Solid,
    Dashed,
    Dotted,
}

const DASHES: [Dash; 3] = [Dash::Solid, Dash::Dashed, Dash::Dotted];

/// The style of series `i`: 12 colours x 5 markers x 3 dash patterns repeat
/// together only after 60 series.
fn style(i: usize) -> (RGBColor, Marker, Dash) {
    (
        COLORS[i % COLORS.len()],
        MARKERS[i % MARKERS.len()],
        DASHES[i % DASHES.len()],
    )
}

/// The marker `shape` in color `c` centred at `at`, sized in pixels (each
/// shape is its own element type: boxed, they draw as one).
fn marker<'a, DB: DrawingBackend + 'a, C: Clone + 'a>(
    shape: Marker,
    c: RGBColor,
    at: C,
) -> DynElement<'a, DB, C> {
    let at = EmptyElement::at(at);
    match shape {
        Marker::Dot => (at + Circle::new((0, 0), 4, c.filled())).into_dyn(),
        Marker::Triangle => (at + TriangleMarker::new((0, 0), 6, c.filled())).into_dyn(),
        Marker::Square => (at + Rectangle::new([(-4, -4), (4, 4)], c.filled())).into_dyn(),
        Marker::Cross => (at + Cross::new((0, 0), 5, c.stroke_width(2))).into_dyn(),
        Marker::Ring => (at + Circle::new((0, 0), 5, c.stroke_width(2))).into_dyn(),
    }
}

/// The smallest and largest x and y of every series' points and ranges
/// (x0 > x1 when there are none).
fn bounds(fig: &Figure) -> (f64, f64, f64, f64) {
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for s in &fig.series {
        for &(x, y) in &s.points {
            (x0, x1) = (x0.min(x), x1.max(x));
            (y0, y1) = (y0.min(y), y1.max(y));
        }
        for &(lo, hi) in &s.ranges {
            (y0, y1) = (y0.min(lo), y1.max(hi));
        }
    }
    (x0, x1, y0, y1)
}

/// A drawing failure of figure `stem`, as the error it is reported by.
fn failed<DB: DrawingBackend>(
    stem: &str,
) -> impl Fn(DrawingAreaErrorKind<DB::ErrorType>) -> Error + Copy + '_
where
    DB::ErrorType: 'static,
{
    move |e| Error::Input(format!("drawing {stem}: {e}"))
}

/// Draws `fig` on `root`: series by series, each series' line, bars,
/// markers and legend entry in its own style, then the notes.
fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, fig: &Figure) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = failed::<DB>(&fig.stem);
    root.fill(&WHITE).map_err(err)?;
    let (plot, legend) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    let (mut x0, mut x1, y0, y1) = bounds(fig);
    let notes = notes(fig, y1 - y0);
    let (mut y0, mut y1) = (y0, y1);
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let (y0, y1) = padded_range(y0, y1, fig.y_from_zero);
    let xs = (x1 - x0).max(1.0);
    let (x_ticks, y_ticks) = (x_ticks(fig), multiples(y0, y1, round_step(y0, y1, 8.0)));
    let (x_step, y_step) = (tick_step(&x_ticks), tick_step(&y_ticks));
    let mut chart = ChartBuilder::on(&plot)
        .caption(&fig.title, (FONT, 22))
        .margin(18)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(
            TickedAxis {
                range: (x0 - 0.04 * xs..x1 + 0.04 * xs).into(),
                ticks: x_ticks,
            },
            TickedAxis {
                range: (y0..y1).into(),
                ticks: y_ticks,
            },
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(&fig.x_label)
        .y_desc(&fig.y_label)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .x_label_formatter(&|v| tick(*v, !fig.scatter, x_step))
        .y_label_formatter(&|v| tick(*v, false, y_step))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    legend.fill(&WHITE).map_err(err)?;
    let mut y = 70;
    for (i, s) in fig.series.iter().enumerate() {
        let (color, shape, dash) = style(i);
        // the first series (single, the reference) is drawn wider, so curves
        // that coincide with it stay visible on top; a long, jagged curve
        // thinner, so its joins stay within the plot
        let line = color.stroke_width(match (i, s.points.len() > DENSE) {
            (0, false) => 4,
            (0, true) | (_, false) => 2,
            (_, true) => 1,
        });
        let pts = s.points.iter().copied();
        if !fig.scatter {
            match dash {
                // segment by segment: a wide polyline's mitred joins at sharp
                // turns (a noisy loss curve) spike far past the points, over
                // the axes and the title
                Dash::Solid => chart.draw_series(
                    s.points
                        .windows(2)
                        .map(|w| PathElement::new(vec![w[0], w[1]], line)),
                ),
                Dash::Dashed => chart.draw_series(DashedLineSeries::new(pts, 10, 6, line)),
                Dash::Dotted => chart.draw_series(DashedLineSeries::new(pts, 2, 6, line)),
            }
            .map_err(err)?;
        }
        let (area, bar) = (chart.plotting_area(), color.stroke_width(2));
        // min-max over the repeats: a vertical bar with caps
        for (&(x, _), &(lo, hi)) in s.points.iter().zip(&s.ranges) {
            area.draw(&PathElement::new(vec![(x, lo), (x, hi)], bar))
                .map_err(err)?;
            for y in [lo, hi] {
                let cap = EmptyElement::at((x, y)) + PathElement::new(vec![(-6, 0), (6, 0)], bar);
                area.draw(&cap).map_err(err)?;
            }
        }
        if fig.scatter && i + 1 == fig.series.len() {
            for &p in &s.points {
                let ring = EmptyElement::at(p) + Circle::new((0, 0), 11, BLACK.stroke_width(3));
                area.draw(&ring).map_err(err)?;
            }
        }
        if fig.markers || fig.scatter {
            for &p in &s.points {
                area.draw(&marker(shape, color, p)).map_err(err)?;
            }
        }
        y = legend_entry(&legend, fig, i, s, line, y)?;
    }
    legend_notes(&legend, fig, &notes, y + 10)?;
    root.present().map_err(err)
}

/// Series `i`'s legend entry at height `y`: its line's sample, ring and
/// marker, and its label wrapped; the height of the next.
fn legend_entry<DB: DrawingBackend>(
    legend: &DrawingArea<DB, Shift>,
    fig: &Figure,
    i: usize,
    s: &Series,
    line: ShapeStyle,
    y: i32,
) -> Result<i32>
where
    DB::ErrorType: 'static,
{
    let err = failed::<DB>(&fig.stem);
    let (color, shape, dash) = style(i);
    let ringed = fig.scatter && i + 1 == fig.series.len();
    if !fig.scatter {
        // the line's sample: its dashes drawn as segments of 8..40
        let segments: &[(i32, i32)] = match dash {
            Dash::Solid => &[(8, 40)],
            Dash::Dashed => &[(8, 18), (26, 40)],
            Dash::Dotted => &[(8, 10), (18, 20), (28, 30), (38, 40)],
        };
        for &(a, b) in segments {
            legend
                .draw(&PathElement::new(vec![(a, y), (b, y)], line))
                .map_err(err)?;
        }
    }
    if ringed {
        let at = EmptyElement::at((24, y));
        legend
            .draw(&(at + Circle::new((0, 0), 11, BLACK.stroke_width(3))))
            .map_err(err)?;
    }
    if fig.markers || fig.scatter {
        legend.draw(&marker(shape, color, (24, y))).map_err(err)?;
    }
    // a long label wraps within the panel instead of running off the image
    let parts = wrap(&s.label, LABEL_CHARS);
    for (k, part) in parts.iter().enumerate() {
        legend
            .draw(&Text::new(
                part.as_str(),
                (48, y - 9 + 18 * k as i32),
                (FONT, 15),
            ))
            .map_err(err)?;
    }
    Ok(y + 26 + 18 * (parts.len() as i32 - 1))
}

/// The figure's notes under the legend, from height `y`.
fn legend_notes<DB: DrawingBackend>(
    legend: &DrawingArea<DB, Shift>,
    fig: &Figure,
    notes: &[String],
    mut y: i32,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = failed::<DB>(&fig.stem);
    for line in notes.iter().flat_map(|n| wrap(n, 30)) {
        legend
            .draw(&Text::new(
                line,
                (8, y),
                (FONT, 15).into_font().color(&BLACK),
            ))
            .map_err(err)?;
        y += 19;
    }
    Ok(())
}

/// Writes `dir/stem.png` and `dir/stem.svg`; returns both paths.
pub fn write(dir: &Path, fig: &Figure) -> Result<Vec<PathBuf>> {
    let size = (WIDTH, HEIGHT);
    let png = png(size, |root| draw(root, fig))?;
    save(dir, &fig.stem, png, svg(size, |root| draw(root, fig))?)
}

/// A figure drawn by `draw` in memory, as PNG bytes.
fn png(
    (w, h): (u32, u32),
    draw: impl FnOnce(DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
) -> Result<Vec<u8>> {
    register_font();
    let mut rgb = vec![0; 3 * w as usize * h as usize];
    draw(BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area())?;
    let mut bytes = Vec::new();
    PngEncoder::new(&mut bytes)
        .write_image(&rgb, w, h, ColorType::Rgb8)
        .map_err(|e| Error::Input(format!("encoding a figure as PNG: {e}")))?;
    Ok(bytes)
}

/// A figure drawn by `draw` in memory, as SVG text.
fn svg(
    size: (u32, u32),
    draw: impl FnOnce(DrawingArea<SVGBackend<'_>, Shift>) -> Result<()>,
) -> Result<String> {
    register_font();
    let mut text = String::new();
    draw(SVGBackend::with_string(&mut text, size).into_drawing_area())?;
    Ok(text)
}

/// Writes `dir/stem.png` and `dir/stem.svg` through `store` (which names a
/// file it cannot write and the OS's reason); returns both paths.
fn save(dir: &Path, stem: &str, png: Vec<u8>, svg: String) -> Result<Vec<PathBuf>> {
    let paths = ["png", "svg"].map(|ext| dir.join(format!("{stem}.{ext}")));
    crate::store::write_atomic(&paths[0], &png)?;
    crate::store::write_atomic(&paths[1], svg.as_bytes())?;
    Ok(paths.into())
}

/// A pipeline timeline: one row per rank, its forwards and backwards as
/// bars over the step's milliseconds (each labelled with its micro-batch,
/// a rank's later chunks darker when interleaved), idle time left white.
pub struct Timeline {
    /// File name without extension.
    pub stem: String,
    pub title: String,
    /// Each row's name and its spans.
    pub rows: Vec<(String, Vec<Span>)>,
}

impl Timeline {
    /// A row for each rank's spans, named by the rank and its stage in `grid`.
    pub fn of_ranks<'a>(
        stem: String,
        title: String,
        grid: &crate::parallel::Grid,
        ranks: impl IntoIterator<Item = &'a Vec<Span>>,
    ) -> Self {
        let rows = ranks
            .into_iter()
            .enumerate()
            .map(|(r, spans)| {
                let stage = grid.coords(r).stage;
                (format!("rank {r} (stage {stage})"), spans.clone())
            })
            .collect();
        Timeline { stem, title, rows }
    }
}

const FORWARD: RGBColor = RGBColor(31, 119, 180);
const BACKWARD: RGBColor = RGBColor(255, 127, 14);
const WEIGHT: RGBColor = RGBColor(44, 160, 44);

/// A pass's color, darker for a later chunk of `chunks`.
fn shade(pass: Pass, chunk: usize, chunks: usize) -> RGBColor {
    let RGBColor(r, g, b) = match pass {
        Pass::Forward => FORWARD,
        Pass::Backward => BACKWARD,
        Pass::Weight => WEIGHT,
    };
    let k = 1.0 - 0.45 * chunk as f64 / (chunks.max(2) - 1) as f64;
    let f = |x: u8| (x as f64 * k) as u8;
    RGBColor(f(r), f(g), f(b))
}

fn draw_timeline<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, tl: &Timeline) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = failed::<DB>(&tl.stem);
    root.fill(&WHITE).map_err(err)?;
    let spans = || tl.rows.iter().flat_map(|(_, s)| s);
    let t0 = spans().map(|s| s.start).fold(f64::MAX, f64::min).min(0.0);
    let t1 = spans().map(|s| s.end).fold(0.0, f64::max).max(1e-6);
    let ms = |t: f64| 1e3 * (t - t0);
    let n = tl.rows.len().max(1);
    let names: Vec<String> = tl.rows.iter().map(|(name, _)| name.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(&tl.title, (FONT, 22))
        .margin(18)
        .x_label_area_size(56)
        .y_label_area_size(120)
        .build_cartesian_2d(0.0..ms(t1) * 1.2, 0.0..n as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("milliseconds into the step's pipeline program")
        .y_labels(n * 2 + 1)
        .y_label_formatter(&|y: &f64| {
            let row = (n as f64 - y - 0.5).round();
            match (y.fract() - 0.5).abs() < 1e-6 && row >= 0.0 {
                true => names.get(row as usize).cloned().unwrap_or_default(),
                false => String::new(),
            }
        })
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()
        .map_err(err)?;
    let chunks = spans().map(|s| s.chunk + 1).max().unwrap_or(1);
    let shade = |pass: Pass, chunk: usize| shade(pass, chunk, chunks);
    for (i, (_, row)) in tl.rows.iter().enumerate() {
        let (lo, hi) = ((n - 1 - i) as f64 + 0.15, (n - i) as f64 - 0.15);
        for s in row {
            let color = shade(s.pass, s.chunk);
            let (x0, x1) = (ms(s.start), ms(s.end));
            let cell = Rectangle::new([(x0, lo), (x1, hi)], color.filled());
            chart.draw_series([cell]).map_err(err)?;
            let font = (FONT, 14).into_font().color(&WHITE);
            let at = ((x0 + x1) / 2.0, (lo + hi) / 2.0);
            chart
                .draw_series([Text::new(s.micro_batch.to_string(), at, font)])
                .map_err(err)?;
        }
    }
    let weights = spans().any(|s| s.pass == Pass::Weight);
    let passes = match weights {
        true => vec![
            (Pass::Forward, "forward"),
            (Pass::Backward, "backward (input)"),
            (Pass::Weight, "backward (weights)"),
        ],
        false => vec![(Pass::Forward, "forward"), (Pass::Backward, "backward")],
    };
    let legend = (0..chunks).flat_map(|c| {
        passes.iter().map(move |&(pass, name)| {
            let label = match chunks {
                1 => name.to_string(),
                _ => format!("{name}, chunk {c}"),
            };
            (label, shade(pass, c))
        })
    });
    for (label, color) in legend {
        chart
            .draw_series([Rectangle::new([(0.0, 0.0), (0.0, 0.0)], color.filled())])
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Writes `dir/stem.png` and `dir/stem.svg` of a timeline; returns both paths.
pub fn write_timeline(dir: &Path, tl: &Timeline) -> Result<Vec<PathBuf>> {
    let size = (WIDTH, 140 + 60 * tl.rows.len() as u32);
    let png = png(size, |root| draw_timeline(root, tl))?;
    save(
        dir,
        &tl.stem,
        png,
        svg(size, |root| draw_timeline(root, tl))?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, points: &[(f64, f64)]) -> Series {
        Series::new(label, points.to_vec())
    }

    fn figure(series: Vec<Series>) -> Figure {
        Figure::lines("t", "t", "x", "y", series, true, false)
    }

    /// A long, jagged curve stays inside the plot (no mitred join spikes
    /// over the title or the axis label) and a long legend label inside
    /// the image (wrapped).
    #[test]
    fn a_jagged_curve_and_a_long_label_stay_inside() {
        register_font();
        let jagged: Vec<(f64, f64)> = (0..800)
            .map(|i| (i as f64, if i % 2 == 0 { 0.0 } else { 10.0 }))
            .collect();
        let mut fig = figure(vec![series(
            &"a-run-name-without-spaces-".repeat(3),
            &jagged,
        )]);
        fig.markers = false;
        let (w, h) = (WIDTH as usize, HEIGHT as usize);
        let mut buf = vec![0u8; w * h * 3];
        draw(
            BitMapBackend::with_buffer(&mut buf, (WIDTH, HEIGHT)).into_drawing_area(),
            &fig,
        )
        .unwrap();
        let red = COLORS[0];
        let is_red = |x: usize, y: usize| {
            let p = &buf[3 * (y * w + x)..3 * (y * w + x) + 3];
            (p[0], p[1], p[2]) == (red.0, red.1, red.2)
        };
        let plot = w - LEGEND_WIDTH as usize;
        // the caption's band and the x axis label's band
        for y in (0..40).chain(h - 50..h) {
            for x in 0..plot {
                assert!(!is_red(x, y), "the curve reaches ({x}, {y})");
            }
        }
        // the label's text ends before the image's edge
        for y in 0..h {
            assert!(
                !(w - 4..w).any(|x| buf[3 * (y * w + x)] < 128),
                "text at the right edge, row {y}"
            );
        }
    }

    #[test]
    fn x_ticks_sit_only_at_measured_batch_sizes() {
        let fig = figure(vec![
            series("ddp x2", &[(8.0, 1.0), (32.0, 2.0)]),
            series("fsdp x2", &[(8.0, 1.0), (16.0, 1.5), (32.0, 2.0)]),
        ]);
        assert_eq!(x_ticks(&fig), [8.0, 16.0, 32.0]);
    }

    /// Each y tick's label reads back as its value, to within half a step,
    /// so no two labels are the same: a throughput axis over 1,015-1,300
    /// tokens/s ticked 1.1k three times, a late loss curve 2.5 five times.
    #[test]
    fn tick_labels_tell_every_tick_apart() {
        for (lo, hi) in [
            (1015.0, 1300.0),
            (2.5001, 2.502),
            (1.0, 1.0),
            (2.001e6, 2.02e6),
            (0.0, 0.004),
            (900.0, 1100.0),
        ] {
            let (lo, hi) = padded_range(lo, hi, false);
            let ticks = multiples(lo, hi, round_step(lo, hi, 8.0));
            assert!((4..=9).contains(&ticks.len()), "{lo}..{hi}: {ticks:?}");
            let step = tick_step(&ticks);
            for t in &ticks {
                let label = tick(*t, false, step);
                let (num, scale) = match label.strip_suffix('k') {
                    Some(n) => (n, 1e3),
                    None => label.strip_suffix('M').map_or((&*label, 1.0), |n| (n, 1e6)),
                };
                let read = num.parse::<f64>().unwrap() * scale;
                assert!(
                    (read - t).abs() < step / 2.0,
                    "{t} labelled {label}, step {step}"
                );
            }
        }
        // a whole-number axis: integers as integers, nothing between them
        assert_eq!(tick(16.0, true, 8.0), "16");
        assert_eq!(tick(2500.0, true, 500.0), "2.5k");
        assert_eq!(tick(2.5, true, 0.5), "");
        // measured steps, their gap no round number: each as it is (the
        // gap's decimals alone wrote 1500 as 2k, 4500 as 4k)
        let steps = [1500.0, 3000.0, 4500.0, 6000.0];
        let labels = steps.map(|v| tick(v, true, tick_step(&steps)));
        assert_eq!(labels, ["1.5k", "3k", "4.5k", "6k"]);
        let epochs = [1563.0, 3126.0, 4689.0];
        assert_eq!(
            epochs.map(|v| tick(v, true, 1563.0)),
            ["1.563k", "3.126k", "4.689k"]
        );
        // a value with no short form: three decimals past the ticks' gap
        assert_eq!(tick(123.456789, false, 50.0), "123.457");
    }

    #[test]
    fn dense_x_ticks_are_round_numbers() {
        let steps: Vec<(f64, f64)> = (1..=40).map(|i| (i as f64, 1.0)).collect();
        assert_eq!(
            x_ticks(&figure(vec![series("single", &steps)])),
            [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0]
        );
    }

    #[test]
    fn coinciding_series_are_named_on_the_figure() {
        let a = [(1.0, 3.0), (2.0, 2.0)];
        let all = figure(vec![
            series("single", &a),
            series("ddp x2", &a),
            series("fsdp x2", &[(1.0, 3.0), (2.0, 2.0 + 1e-6)]),
        ]);
        assert_eq!(notes(&all, 1.0), ["3 series coincide: all follow single"]);
        let some = figure(vec![
            series("single", &a),
            series("ddp x2", &[(1.0, 1.0), (2.0, 0.5)]),
            series("tp x2", &a),
        ]);
        assert_eq!(
            notes(&some, 2.5),
            ["2 series coincide: tp x2 follows single"]
        );
        let apart = figure(vec![
            series("a", &a),
            series("b", &[(1.0, 1.0), (2.0, 0.5)]),
        ]);
        assert!(notes(&apart, 2.5).is_empty());
    }

    #[test]
    fn fourteen_series_have_fourteen_styles() {
        let mut seen = Vec::new();
        for i in 0..14 {
            let (c, m, d) = style(i);
            let key = (c, m as usize, d as usize);
            assert!(!seen.contains(&key), "series {i} repeats a style");
            seen.push(key);
        }
    }
}
