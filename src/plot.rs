//! `distgpt plot`: the curves of one or several runs from their
//! `metrics.jsonl` — training loss, validation loss, gradient norm and
//! throughput against the optimizer step, and a classifier's validation
//! accuracy and F1, as PNG and SVG.

use crate::error::{Error, Result};
use crate::figure::{self, Figure, Series};
use crate::train::run_dir::{METRICS_FILE, RUN_FILE};
use crate::train::TaskKind;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The fields of a `metrics.jsonl` line the figures draw.
#[derive(Deserialize)]
struct Point {
    step: usize,
    loss: f64,
    val_loss: Option<f64>,
    /// A classifier's validation accuracy and F1.
    val_accuracy: Option<f64>,
    val_f1: Option<f64>,
    grad_norm: f64,
    tokens_per_s: f64,
}

/// The field of `run.json` the figures need: what the run trains (its
/// loss's unit; absent in records before BERT runs had one: lm).
#[derive(Deserialize)]
struct Trains {
    #[serde(default)]
    task: TaskKind,
}

/// One run's steps, in step order.
pub struct Curves {
    /// The legend label: the run directory's name.
    pub label: String,
    points: Vec<Point>,
    /// Its loss's unit ([`TaskSpec::loss_unit`](crate::train::spec::TaskSpec)).
    loss_unit: &'static str,
}

impl Curves {
    /// Reads `run/metrics.jsonl`. A step logged twice keeps its later line.
    pub fn read(run: &Path) -> Result<Curves> {
        let path = run.join(METRICS_FILE);
        if !path.exists() {
            return Err(Error::Input(format!(
                "{} has no {METRICS_FILE}: give run directories written by `distgpt train`",
                run.display()
            )));
        }
        let text = crate::store::read_text(&path)?;
        // by step: a step logged again replaces its line, in one lookup (a
        // long run's file is hundreds of thousands of lines)
        let mut points = std::collections::BTreeMap::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let p: Point = serde_json::from_str(line).map_err(|e| {
                Error::Input(format!(
                    "{} line {}: not a metrics record ({e})",
                    path.display(),
                    i + 1
                ))
            })?;
            points.insert(p.step, p);
        }
        if points.is_empty() {
            return Err(Error::Input(format!(
                "{} records no step yet",
                path.display()
            )));
        }
        let points: Vec<Point> = points.into_values().collect();
        let label = std::fs::canonicalize(run)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| run.display().to_string());
        // a folder whose run.json is missing or unreadable plots as a
        // language model's
        let task = crate::store::read_text(&run.join(RUN_FILE))
            .ok()
            .and_then(|text| serde_json::from_str::<Trains>(&text).ok())
            .map_or(TaskKind::Lm, |t| t.task);
        Ok(Curves {
            label,
            points,
            loss_unit: task.spec().loss_unit,
        })
    }

    fn series(&self, value: impl Fn(&Point) -> Option<f64>) -> Series {
        let points = self
            .points
            .iter()
            .filter_map(|p| value(p).map(|v| (p.step as f64, v)));
        Series::new(self.label.clone(), points.collect())
    }
}

/// Gives runs that share a directory name distinct labels ("name (2)").
fn distinct_labels(runs: &mut [Curves]) {
    for i in 1..runs.len() {
        let base = runs[i].label.clone();
        let mut n = 1;
        while runs[..i].iter().any(|r| r.label == runs[i].label) {
            n += 1;
            runs[i].label = format!("{base} ({n})");
        }
    }
}

/// The four figures of `runs`, and for classifiers the validation accuracy
/// and F1 (evaluated at every epoch's end).
pub fn figures(runs: &[Curves]) -> Vec<Figure> {
    let fig = |stem: &str, title: &str, y: &str, series: Vec<Series>, markers| {
        Figure::lines(stem, title, "optimizer step", y, series, markers, false)
    };
    let each = |value: fn(&Point) -> Option<f64>| -> Vec<Series> {
        runs.iter()
            .map(|r| r.series(value))
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    // runs of tasks whose losses differ in unit share the figure
    let mut units: Vec<&str> = runs.iter().map(|r| r.loss_unit).collect();
    units.sort();
    units.dedup();
    let loss = match units[..] {
        [unit] => format!("loss ({unit})"),
        _ => "loss (nats; each run's task's unit)".to_string(),
    };
    let mut figs = vec![
        fig(
            "loss",
            "training loss",
            &loss,
            each(|p| Some(p.loss)),
            false,
        ),
        fig(
            "val_loss",
            "validation loss",
            &loss,
            each(|p| p.val_loss),
            true,
        ),
        fig(
            "grad_norm",
            "global gradient norm (before clipping)",
            "gradient norm",
            each(|p| Some(p.grad_norm)),
            false,
        ),
        fig(
            "throughput",
            "training throughput",
            "tokens/s (all ranks)",
            each(|p| Some(p.tokens_per_s)),
            false,
        ),
    ];
    let accuracy = each(|p| p.val_accuracy.map(|a| 100.0 * a));
    if !accuracy.is_empty() {
        figs.push(fig(
            "accuracy",
            "validation accuracy",
            "accuracy (%)",
            accuracy,
            true,
        ));
        figs.push(fig("f1", "validation F1", "F1", each(|p| p.val_f1), true));
    }
    figs
}

/// Reads every run and writes the figures into `out` (created); returns
/// the files written.
pub fn plot(runs: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>> {
    let mut curves = runs
        .iter()
        .map(|r| Curves::read(r))
        .collect::<Result<Vec<_>>>()?;
    distinct_labels(&mut curves);
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut written = Vec::new();
    for f in figures(&curves) {
        written.extend(figure::write(out, &f)?);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testdir::TestDir;

    /// A fresh directory `my-run` in a test folder (removed with its guard).
    fn scratch(tag: &str) -> (TestDir, PathBuf) {
        let root = TestDir::new(&format!("plot-{tag}"));
        let dir = root.path().join("my-run");
        std::fs::create_dir_all(&dir).unwrap();
        (root, dir)
    }

    fn run_with(tag: &str, lines: &str) -> (TestDir, PathBuf) {
        let (root, run) = scratch(tag);
        std::fs::write(run.join(METRICS_FILE), lines).unwrap();
        (root, run)
    }

    const LINE: &str = r#"{"step":STEP,"epoch":0.1,"loss":LOSS,"grad_norm":1.5,"lr":0.001,"ms":10.0,"tokens_per_s":100.0,"mfu":0.1,"memory":{},"rank_peak_bytes":[],"comm":{}}"#;

    fn line(step: usize, loss: f64) -> String {
        LINE.replace("STEP", &step.to_string())
            .replace("LOSS", &loss.to_string())
            + "\n"
    }

    #[test]
    fn curves_keep_the_later_line_of_a_step_and_validation_points_only_where_logged() {
        let val = line(2, 3.0).replace(r#""grad_norm""#, r#""val_loss":3.5,"grad_norm""#);
        let (_root, run) = run_with(
            "order",
            &(line(1, 4.0) + &line(2, 9.0) + &val + &line(3, 2.0)),
        );
        let c = Curves::read(&run).unwrap();
        assert_eq!(c.label, "my-run");
        let figs = figures(&[c]);
        assert_eq!(
            figs[0].series[0].points,
            [(1.0, 4.0), (2.0, 3.0), (3.0, 2.0)]
        );
        assert_eq!(figs[1].series[0].points, [(2.0, 3.5)]);
    }

    #[test]
    fn a_missing_or_corrupt_log_is_named() {
        let e = Curves::read(&scratch("none").1).err().unwrap().to_string();
        assert!(e.contains("has no metrics.jsonl"), "{e}");
        let (_corrupt, run) = run_with("corrupt", &(line(1, 4.0) + "{\"step\": oops\n"));
        let e = Curves::read(&run).err().unwrap().to_string();
        assert!(e.contains("line 2: not a metrics record"), "{e}");
        let (_empty, run) = run_with("empty", "");
        let e = Curves::read(&run).err().unwrap().to_string();
        assert!(e.contains("records no step yet"), "{e}");
    }

    /// A pipe where the log belongs is refused by name, not read (opening
    /// one no one writes blocked `plot` for ever).
    #[test]
    fn a_pipe_where_the_log_belongs_is_refused_not_read() {
        let (_root, run) = scratch("fifo");
        crate::store::pipes::make_fifo(&run.join(METRICS_FILE));
        let e =
            crate::store::pipes::within_20_s(move || Curves::read(&run).err().unwrap().to_string());
        assert!(e.contains("metrics.jsonl is not a regular file"), "{e}");
    }

    /// A loss is labelled in its task's unit, read from run.json: a
    /// classifier's is per sequence (it was labelled nats/token), a folder
    /// without run.json a language model's; runs of two units say so.
    #[test]
    fn a_loss_is_labelled_in_its_tasks_unit() {
        let (_lm, lm) = run_with("lm", &line(1, 4.0));
        let (_cls, cls) = run_with("classify", &line(1, 0.7));
        std::fs::write(cls.join(RUN_FILE), r#"{"task":"classify","more":1}"#).unwrap();
        let y = |runs: &[&Path]| -> Vec<String> {
            let curves: Vec<Curves> = runs.iter().map(|r| Curves::read(r).unwrap()).collect();
            figures(&curves)[..2]
                .iter()
                .map(|f| f.y_label.clone())
                .collect()
        };
        assert_eq!(y(&[&lm]), ["loss (nats/token)"; 2]);
        assert_eq!(y(&[&cls]), ["loss (nats/sequence)"; 2]);
        assert_eq!(
            y(&[&lm, &cls, &lm]),
            ["loss (nats; each run's task's unit)"; 2]
        );
    }

    #[test]
    fn runs_of_the_same_name_get_distinct_labels() {
        let mk = |l: &str| Curves {
            label: l.into(),
            points: Vec::new(),
            loss_unit: "",
        };
        let mut runs = [mk("a"), mk("a"), mk("b"), mk("a")];
        distinct_labels(&mut runs);
        let labels: Vec<&str> = runs.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(labels, ["a", "a (2)", "b", "a (3)"]);
    }
}
