//! `compare`: trains a matrix of strategies x world sizes x batch sizes (x
//! models) on the same data and seed, one run at a time on thread ranks, and
//! turns the runs into one row each, with `plan`'s prediction beside what
//! was measured. Each cell runs `repeats` times: the tables and figures show
//! the median step time, the figures its min-max range. `report` writes the
//! tables, `figures` the plots.

pub mod classify;
pub mod figures;
pub mod report;

pub use crate::metrics::Spread;

use crate::backend::cpu::Cpu;
use crate::backend::PeakRow;
use crate::data::Dataset;
use crate::error::{Error, Result};
use crate::metrics::StepRecord;
use crate::model::ModelConfig;
use crate::parallel::{pipeline, ParallelConfig, Pipeline, Schedule, Span, StrategyKind};
use crate::plan::calibrate::{calibrate_cpu, Calibration, Machine};
use crate::plan::{self, Precision, Workload};
use crate::train::{self, Duration, TrainConfig, TrainSummary};
use indicatif::MultiProgress;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

/// A strategy as the matrix names it; `mesh` is ddp over tensor-parallel pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    Single,
    Ddp,
    Zero1,
    Zero2,
    Fsdp,
    Tp,
    Mesh,
    /// ddp over 2-stage pipelines (1f1b).
    Pp,
    /// ddp over 2-stage pipelines (gpipe).
    Gpipe,
    /// ddp over 2-stage pipelines (interleaved 1f1b, two chunks a rank).
    Interleaved,
    /// ddp over 2-stage pipelines (zb-h1).
    Zb,
}

crate::display_as_flag!(Layout);

impl Layout {
    /// The parallel configuration on `world` ranks (single ignores the
    /// world size): a strategy, its tensor-parallel degree, and the
    /// schedule of its 2-stage pipeline where it has one.
    fn parallel(self, world: usize) -> ParallelConfig {
        use StrategyKind::*;
        let (strategy, tp, pipe) = match self {
            Layout::Single => (Single, 1, None),
            Layout::Ddp => (Ddp, 1, None),
            Layout::Zero1 => (Zero1, 1, None),
            Layout::Zero2 => (Zero2, 1, None),
            Layout::Fsdp => (Fsdp, 1, None),
            Layout::Tp => (Tp, world, None),
            Layout::Mesh => (Ddp, 2, None),
            Layout::Pp => (Ddp, 1, Some(Schedule::OneFOneB)),
            Layout::Gpipe => (Ddp, 1, Some(Schedule::GPipe)),
            Layout::Interleaved => (Ddp, 1, Some(Schedule::Interleaved)),
            Layout::Zb => (Ddp, 1, Some(Schedule::ZbH1)),
        };
        ParallelConfig {
            strategy,
            world_size: if strategy == Single { 1 } else { world },
            tp,
            pipeline: Pipeline::new(1 + pipe.is_some() as usize, pipe.unwrap_or_default(), 2),
            ..ParallelConfig::single()
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct CompareSpec {
    /// (preset name, model) pairs.
    pub models: Vec<(String, ModelConfig)>,
    pub layouts: Vec<Layout>,
    pub world_sizes: Vec<usize>,
    pub batch_sizes: Vec<usize>,
    pub seq_len: usize,
    /// Micro-batches per optimizer step, every cell (a pipeline's in flight).
    pub grad_accum: usize,
    pub duration: Duration,
    pub lr: f32,
    pub seed: u64,
    pub eval_batches: usize,
    pub out_dir: PathBuf,
    pub threads: usize,
    /// Predict each run with `plan` calibrated on this machine.
    pub predict: bool,
    /// Runs of each cell; step times are summarised by their median.
    pub repeats: usize,
    /// Print the estimated duration (from `plan`'s predictions) before starting.
    pub announce_estimate: bool,
}

/// One cell of the matrix.
#[derive(Clone, Debug)]
pub struct Cell {
    pub model_name: String,
    pub model: ModelConfig,
    pub parallel: ParallelConfig,
    pub batch: usize,
}

impl Cell {
    /// "fsdp x2", "single", "ddp x4 (tp 2)".
    pub fn label(&self) -> String {
        self.parallel.layout_name()
    }
}

/// The valid cells of the matrix, and a line for each skipped combination.
pub fn cells(spec: &CompareSpec) -> (Vec<Cell>, Vec<String>) {
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for (name, model) in &spec.models {
        let (pairs, why) = layout_cells(
            name,
            &spec.layouts,
            &spec.world_sizes,
            &spec.batch_sizes,
            model,
            spec.grad_accum,
        );
        skipped.extend(why);
        out.extend(pairs.into_iter().map(|(parallel, batch)| Cell {
            model_name: name.clone(),
            model: model.clone(),
            parallel,
            batch,
        }));
    }
    (out, skipped)
}

/// The (layout, global batch) pairs of a matrix over (layouts, world sizes,
/// batches) that can train `model` at `grad_accum` micro-batches a step
/// (what a run checks before its first step), and a line for each one
/// skipped.
pub fn layout_cells(
    name: &str,
    layouts: &[Layout],
    world_sizes: &[usize],
    batch_sizes: &[usize],
    model: &ModelConfig,
    grad_accum: usize,
) -> (Vec<(ParallelConfig, usize)>, Vec<String>) {
    let valid = |par: ParallelConfig, batch| {
        par.validate(model, batch)?;
        par.pipeline.check_micro_batches(grad_accum)
    };
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for &layout in layouts {
        // one rank of a parallel strategy is `single` again
        let single = layout == Layout::Single;
        if !single && world_sizes.contains(&1) {
            skipped.push(format!(
                "{name} {layout} x1: one rank of a parallel strategy is single's run (its row is single's)"
            ));
        }
        let worlds = world_sizes.iter().copied().filter(|&w| w > 1 && !single);
        for world in worlds.chain(single.then_some(1)) {
            if layout == Layout::Mesh && world < 4 {
                skipped.push(format!(
                    "{name} mesh x{world}: a dp x tp 2 mesh needs a world of at least 4"
                ));
                continue;
            }
            // the batches skipped for each reason, a line a reason
            let mut why: Vec<(String, Vec<String>)> = Vec::new();
            for &batch in batch_sizes {
                let par = layout.parallel(world);
                let reason = match valid(par, batch) {
                    Ok(()) => {
                        out.push((par, batch));
                        continue;
                    }
                    Err(Error::Config(m)) => m,
                    Err(e) => e.to_string(),
                };
                match why.iter_mut().find(|(r, _)| *r == reason) {
                    Some((_, batches)) => batches.push(batch.to_string()),
                    None => why.push((reason, vec![batch.to_string()])),
                }
            }
            skipped.extend(why.into_iter().map(|(reason, batches)| {
                format!(
                    "{name} {layout} x{world} batch {}: {reason}",
                    batches.join(", ")
                )
            }));
        }
    }
    (out, skipped)
}

/// Prints the skipped combinations (before any bar is drawn, so plain
/// stderr is fine and seen when piped); an empty matrix is an error that
/// says why its first cells were skipped.
fn say_skipped(skipped: &[String], none_left: bool) -> Result<()> {
    if none_left {
        let (first, more) = skipped.split_at(skipped.len().min(3));
        let why: Vec<String> = first.iter().map(|s| format!("; skipped {s}")).collect();
        let more = match more.len() {
            0 => String::new(),
            n => format!("; and {n} more"),
        };
        return Err(Error::Config(format!(
            "no valid run in the matrix: check --strategies, --world-sizes and --batch-sizes{}{more}",
            why.concat()
        )));
    }
    for s in skipped {
        crate::errln!("skipped {s}");
    }
    Ok(())
}

/// One epoch of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EpochPoint {
    pub epoch: usize,
    /// Seconds of optimizer steps in this epoch (evaluation excluded).
    pub seconds: f64,
    /// Largest peak bytes of any rank by the end of the epoch.
    pub peak_bytes: u64,
    pub mean_grad_norm: f64,
    pub mean_loss: f64,
    /// Epochs of data its steps read: 1 for a whole epoch (a little more
    /// where its last step reads into the next), less for a run's partial
    /// last one.
    pub covered: f64,
}

/// Optimizer steps an epoch, from a run's first step record: the inverse
/// of the epochs one step reads (0 for a run of none).
fn steps_per_epoch(h: &[StepRecord]) -> f64 {
    h.first().map_or(0.0, |r| 1.0 / r.epoch)
}

impl EpochPoint {
    /// The epochs of a run's step records, each step in the epoch it began
    /// in (a step that reads on into the next epoch is its last).
    fn of(h: &[StepRecord]) -> Vec<EpochPoint> {
        let mut out: Vec<EpochPoint> = Vec::new();
        let mut counts: Vec<usize> = Vec::new();
        let mut began = 0.0f64;
        for r in h {
            let e = crate::metrics::whole_epochs(began);
            if out.len() <= e {
                out.resize_with(e + 1, EpochPoint::default);
                counts.resize(e + 1, 0);
            }
            let p = &mut out[e];
            p.epoch = e + 1;
            p.seconds += r.ms / 1e3;
            p.covered += r.epoch - began;
            p.peak_bytes = p
                .peak_bytes
                .max(r.rank_peak_bytes.iter().map(|x| x.total).max().unwrap_or(0));
            p.mean_grad_norm += r.grad_norm as f64;
            p.mean_loss += r.loss as f64;
            counts[e] += 1;
            began = r.epoch;
        }
        for (p, &n) in out.iter_mut().zip(&counts) {
            p.mean_grad_norm /= n.max(1) as f64;
            p.mean_loss /= n.max(1) as f64;
        }
        out.retain(|p| p.epoch > 0);
        out
    }

    /// Seconds an epoch takes at this epoch's pace (a partial epoch's time
    /// scaled to a whole one).
    pub fn time_per_epoch(&self) -> f64 {
        self.seconds / self.covered
    }
}

/// `plan`'s prediction for a run.
#[derive(Clone, Debug, Serialize)]
pub struct Predicted {
    pub peak_bytes: f64,
    pub step_ms: f64,
}

/// The timings of one repeat of a cell.
#[derive(Clone, Debug, Serialize)]
pub struct RepeatTiming {
    /// Mean over the steps after the first (which allocates).
    pub step_ms: f64,
    pub tokens_per_s: f64,
}

/// One row of the report.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub model: String,
    pub params: usize,
    pub label: String,
    pub strategy: StrategyKind,
    pub world_size: usize,
    pub tp: usize,
    pub batch: usize,
    pub seq_len: usize,
    pub steps: usize,
    pub epochs: f64,
    /// Median over the repeats of the mean step time after the first step.
    pub step_ms: f64,
    /// Median over the repeats.
    pub tokens_per_s: f64,
    pub tokens_per_s_per_rank: f64,
    /// Median step time x optimizer steps per epoch.
    pub time_per_epoch_s: f64,
    /// Every repeat's timings, in the order they ran.
    pub repeats: Vec<RepeatTiming>,
    /// Peak bytes of every rank: [params, grads, optimizer, activations, other, total].
    pub rank_peak_bytes: Vec<PeakRow>,
    pub final_loss: f32,
    pub val_loss: f32,
    pub final_grad_norm: f32,
    /// Rank 0's collective traffic and time per step.
    pub comm_bytes_per_step: f64,
    pub comm_ms_per_step: f64,
    /// Largest |loss - single's loss| over the steps, same model and batch.
    pub max_loss_deviation_from_single: Option<f64>,
    pub predicted: Option<Predicted>,
    pub pipeline: Pipeline,
    /// A pipeline's idle fraction in the first repeat's last step, measured
    /// over every rank, and by the schedule's formula.
    pub bubble: Option<f64>,
    pub bubble_formula: Option<f64>,
    /// Every rank's forwards and backwards in that step (drawn as a timeline).
    #[serde(skip)]
    pub timelines: Vec<Vec<Span>>,
    /// The first repeat's epochs (memory, loss and gradient norm do not vary between repeats).
    pub per_epoch: Vec<EpochPoint>,
    pub losses: Vec<f32>,
}

impl RunResult {
    /// The rank with the largest peak total.
    pub fn max_peak(&self) -> PeakRow {
        PeakRow::largest(&self.rank_peak_bytes)
    }

    /// Tokens per second over the repeats.
    pub fn tokens_per_s_spread(&self) -> Spread {
        Spread::of(self.repeats.iter().map(|r| r.tokens_per_s))
    }

    /// Step time over the repeats.
    pub fn step_ms_spread(&self) -> Spread {
        Spread::of(self.repeats.iter().map(|r| r.step_ms))
    }

    /// One row from a cell's repeats (at least one).
    fn from_summaries(
        cell: &Cell,
        seq_len: usize,
        accum: usize,
        summaries: &[TrainSummary],
    ) -> Self {
        let tokens = (cell.batch * seq_len * accum) as f64;
        let repeats: Vec<RepeatTiming> = summaries
            .iter()
            .map(|s| {
                let step_ms = mean_step_ms(&s.history);
                RepeatTiming {
                    step_ms,
                    tokens_per_s: tokens / (step_ms / 1e3),
                }
            })
            .collect();
        let step_ms = Spread::of(repeats.iter().map(|r| r.step_ms)).median;
        // the repeats' median rate (with an even count, not the rate of
        // their median step time)
        let tokens_per_s = Spread::of(repeats.iter().map(|r| r.tokens_per_s)).median;
        let step_s = step_ms / 1e3;
        let s = &summaries[0];
        let h = &s.history;
        let per_epoch = EpochPoint::of(h);
        let world = cell.parallel.world_size;
        let trained = s.losses.len().max(1) as f64;
        RunResult {
            model: cell.model_name.clone(),
            params: cell.model.num_params(),
            label: cell.label(),
            strategy: cell.parallel.strategy,
            world_size: world,
            tp: cell.parallel.tp,
            batch: cell.batch,
            seq_len,
            steps: s.steps,
            epochs: h.last().map_or(0.0, |r| r.epoch),
            step_ms,
            tokens_per_s,
            tokens_per_s_per_rank: tokens_per_s / world as f64,
            time_per_epoch_s: step_s * steps_per_epoch(h),
            repeats,
            rank_peak_bytes: s.rank_peak_bytes.clone(),
            final_loss: s.final_loss,
            val_loss: s.val_loss,
            final_grad_norm: h.last().map_or(f32::NAN, |r| r.grad_norm),
            comm_bytes_per_step: s.step_comm.total_bytes() as f64 / trained,
            comm_ms_per_step: s.step_comm.seconds * 1e3 / trained,
            max_loss_deviation_from_single: None,
            predicted: None,
            pipeline: cell.parallel.pipeline,
            bubble: pipeline::measured_bubble(&s.timelines),
            bubble_formula: (cell.parallel.pipeline.stages > 1)
                .then(|| cell.parallel.pipeline.expected_bubble(accum, &s.timelines)),
            timelines: s.timelines.clone(),
            per_epoch,
            losses: s.losses.clone(),
        }
    }
}

/// Fills each run's largest loss deviation from `single` on the same model and batch.
fn deviations(results: &mut [RunResult]) {
    let singles: Vec<(String, usize, Vec<f32>)> = results
        .iter()
        .filter(|r| r.strategy == StrategyKind::Single)
        .map(|r| (r.model.clone(), r.batch, r.losses.clone()))
        .collect();
    for r in results.iter_mut() {
        r.max_loss_deviation_from_single = singles
            .iter()
            .find(|(m, b, _)| *m == r.model && *b == r.batch)
            .map(|(_, _, base)| loss_deviation(base, &r.losses));
    }
}

/// A run's mean step time in ms: of the steps after the first (which
/// allocates), or the first's where it is the only one.
fn mean_step_ms(history: &[StepRecord]) -> f64 {
    let timed = if history.len() > 1 {
        &history[1..]
    } else {
        history
    };
    timed.iter().map(|r| r.ms).sum::<f64>() / timed.len().max(1) as f64
}

/// Largest |`a[i]` - `b[i]`| over the steps both have.
fn loss_deviation(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
}

/// What `run` produced: every finished cell, and whether a signal cut it short.
pub struct Comparison {
    pub results: Vec<RunResult>,
    pub calibrations: Vec<Calibration>,
    /// Cells in the matrix; `results` holds fewer when stopped.
    pub planned_cells: usize,
    /// A signal (`train::INTERRUPTED`) stopped the matrix before its end.
    pub stopped: bool,
}

/// `plan`'s prediction for a cell, calibrating this machine for its
/// (model, batch, world) once.
fn predict_cell(
    machine: &Machine,
    calibrations: &mut Vec<Calibration>,
    cell: &Cell,
    seq_len: usize,
    grad_accum: usize,
) -> Result<Predicted> {
    let world = cell.parallel.world_size;
    let model = cell.model.clone();
    let key = |c: &Calibration| c.model == model && c.batch == cell.batch && c.ranks == world;
    if !calibrations.iter().any(key) {
        calibrations.push(calibrate_cpu(machine, &model, cell.batch, seq_len, world)?);
    }
    let cal = calibrations.iter().find(|c| key(c)).expect("just added");
    let w = Workload {
        model,
        batch: cell.batch,
        seq_len,
        grad_accum,
        cpu_threads: Some(machine.threads),
    };
    let p = plan::predict(
        &w,
        cell.parallel,
        &cal.device(f64::INFINITY),
        &machine.network(),
        Precision::Fp32,
    );
    Ok(Predicted {
        peak_bytes: p.memory.total(),
        step_ms: p.time.step_s() * 1e3,
    })
}

/// Seconds the matrix should take over `windows` training sequences:
/// predicted step time (all its micro-batches) x steps x repeats.
fn estimate_s(spec: &CompareSpec, windows: usize, cells: &[Cell], predicted: &[Predicted]) -> f64 {
    cells
        .iter()
        .zip(predicted)
        .map(|(c, p)| {
            let steps = (spec.duration)
                .steps(windows / c.batch.max(1), spec.grad_accum)
                .max(1);
            p.step_ms / 1e3 * steps as f64 * spec.repeats as f64
        })
        .sum()
}

/// Says how many runs the matrix has and, with plan's predictions, about
/// how long they will train.
fn announce(spec: &CompareSpec, ds: &Dataset, cells: &[Cell], predicted: &[Predicted]) {
    if predicted.is_empty() {
        crate::errln!(
            "{} runs ({} cells x {} repeats); no time estimate without plan's predictions (--no-predict)",
            cells.len() * spec.repeats,
            cells.len(),
            spec.repeats
        );
    } else {
        let windows = ds.train.windows(spec.seq_len.max(1));
        let secs = estimate_s(spec, windows, cells, predicted);
        crate::errln!(
            "{} runs ({} cells x {} repeats), estimated {:.0} min {:02.0} s of training (plan's step times; Ctrl-C stops and writes a partial report)",
            cells.len() * spec.repeats,
            cells.len(),
            spec.repeats,
            (secs / 60.0).floor(),
            secs % 60.0
        );
    }
}

/// The folder of `cell`'s run `repeat` (of `repeats`) under the report's
/// `runs/`: model, strategy, world, tp and batch, and its pipeline and
/// repeat where it has them.
fn run_name(cell: &Cell, repeat: usize, repeats: usize) -> String {
    let par = &cell.parallel;
    let mut name = format!(
        "{}-{}-x{}-tp{}-b{}",
        cell.model_name, par.strategy, par.world_size, par.tp, cell.batch
    );
    if par.pipeline.stages > 1 {
        name.push_str(&format!(
            "-pp{}-{}",
            par.pipeline.stages, par.pipeline.schedule
        ));
    }
    if repeats > 1 {
        name.push_str(&format!("-r{}", repeat + 1));
    }
    name
}

/// The training settings of `cell`'s run `repeat`.
fn run_config(spec: &CompareSpec, cell: &Cell, repeat: usize) -> TrainConfig {
    let name = run_name(cell, repeat, spec.repeats);
    TrainConfig {
        batch_size: cell.batch,
        seq_len: spec.seq_len,
        grad_accum: spec.grad_accum,
        duration: spec.duration,
        lr: spec.lr,
        min_lr: spec.lr / 10.0,
        warmup_steps: 10,
        eval_batches: spec.eval_batches,
        sample_tokens: 0,
        seed: spec.seed,
        out_dir: spec.out_dir.join("runs").join(name),
        // The report directory's runs are compare's own: a rerun into
        // the same --out replaces them.
        overwrite: true,
        ..TrainConfig::default()
    }
}

/// Checks the training settings every cell's runs take (a rate, a
/// duration), before a calibration, a run or the report's folder.
pub fn check(spec: &CompareSpec) -> Result<()> {
    let (cells, _) = cells(spec);
    cells
        .iter()
        .try_for_each(|cell| run_config(spec, cell, 0).validate())
}

/// Runs every cell `spec.repeats` times (bars on `multi`), returning one row
/// per cell and the calibrations used for the predictions. A signal stops
/// after the current step; the cell it cut short is left out.
pub fn run(spec: &CompareSpec, ds: &Dataset, multi: &MultiProgress) -> Result<Comparison> {
    let (cells, skipped) = cells(spec);
    say_skipped(&skipped, cells.is_empty())?;
    // measured and predicted before the runs, on a quiet machine
    let mut calibrations: Vec<Calibration> = Vec::new();
    let mut predicted: Vec<Predicted> = Vec::new();
    if spec.predict {
        let machine = Machine::measure(spec.threads)?;
        for cell in &cells {
            predicted.push(predict_cell(
                &machine,
                &mut calibrations,
                cell,
                spec.seq_len,
                spec.grad_accum,
            )?);
        }
    }
    if spec.announce_estimate {
        announce(spec, ds, &cells, &predicted);
    }
    let outer = multi.add(crate::metrics::progress_bar(
        (cells.len() * spec.repeats) as u64,
        "matrix",
    ));
    let mut results = Vec::with_capacity(cells.len());
    let mut stopped = false;
    'cells: for (i, cell) in cells.iter().enumerate() {
        let mut summaries = Vec::with_capacity(spec.repeats);
        for repeat in 0..spec.repeats {
            outer.set_message(format!(
                "{} {} batch {} (repeat {}/{})",
                cell.model_name,
                cell.label(),
                cell.batch,
                repeat + 1,
                spec.repeats
            ));
            let bar = multi.add(crate::metrics::progress_bar(1, "  run   "));
            let cfg = TrainConfig {
                progress: Some(bar.clone()),
                ..run_config(spec, cell, repeat)
            };
            let task = train::lm::LmTask {
                model: cell.model.clone(),
                data: ds,
            };
            let summary = train::train(
                Cpu::new,
                &task,
                &cfg,
                cell.parallel,
                spec.threads,
                std::time::Duration::from_secs(600),
            )?;
            multi.remove(&bar);
            if train::INTERRUPTED.load(Ordering::SeqCst) {
                stopped = true;
                break 'cells;
            }
            outer.inc(1);
            let what = format!("{} {} batch {}", cell.model_name, cell.label(), cell.batch);
            run_done(&outer, &what, &summary);
            summaries.push(summary);
        }
        let mut row = RunResult::from_summaries(cell, spec.seq_len, spec.grad_accum, &summaries);
        row.predicted = predicted.get(i).cloned();
        results.push(row);
    }
    outer.finish_and_clear();
    deviations(&mut results);
    Ok(Comparison {
        results,
        calibrations,
        planned_cells: cells.len(),
        stopped,
    })
}

/// A line above the matrix's bar (on stderr, alone, when it is hidden
/// because stderr is not a terminal) as each run ends.
pub(crate) fn run_done(outer: &indicatif::ProgressBar, what: &str, s: &train::TrainSummary) {
    let done = outer.position();
    let all = outer.length().unwrap_or(done);
    crate::metrics::say(
        outer,
        &format!(
            "run {done}/{all} {what}: {} in {:.1} s, loss {:.4} -> {:.4}, {:.0} tokens/s",
            crate::metrics::count(s.losses.len(), "step"),
            s.seconds,
            s.first_loss,
            s.final_loss,
            s.tokens_per_s
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;
    use crate::parallel::pipeline::{Pipeline, Schedule};

    /// A step counts in the epoch it began in: 7 batches an epoch read 2 a
    /// step make 4 steps an epoch, the last reading on into the next, and
    /// one epoch is one point (it was two: the crossing step was a second
    /// epoch of 0.06 s). A partial last epoch's time is scaled to a whole.
    #[test]
    fn a_step_belongs_to_the_epoch_it_began_in() {
        // a step of 2 of 7 batches: 3.5 steps an epoch
        let first = StepRecord {
            epoch: 2.0 / 7.0,
            ..StepRecord::default()
        };
        assert!((steps_per_epoch(&[first]) - 3.5).abs() < 1e-12);
        assert_eq!(steps_per_epoch(&[]), 0.0);
        let record = |batches: usize, ms| StepRecord {
            epoch: batches as f64 / 7.0,
            ms,
            loss: 2.0,
            ..StepRecord::default()
        };
        let one = [
            record(2, 100.0),
            record(4, 100.0),
            record(6, 100.0),
            record(8, 100.0),
        ];
        let epochs = EpochPoint::of(&one);
        assert_eq!(epochs.len(), 1);
        assert_eq!((epochs[0].epoch, epochs[0].seconds), (1, 0.4));
        assert!((epochs[0].covered - 8.0 / 7.0).abs() < 1e-12);
        // two and a half epochs of 10 batches, one a step, 50 ms each
        let h: Vec<StepRecord> = (1..=25)
            .map(|i| StepRecord {
                epoch: i as f64 / 10.0,
                ms: 50.0,
                ..StepRecord::default()
            })
            .collect();
        let epochs = EpochPoint::of(&h);
        let times: Vec<f64> = epochs.iter().map(|p| p.time_per_epoch()).collect();
        assert_eq!(
            epochs.iter().map(|p| p.epoch).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert!(times.iter().all(|t| (t - 0.5).abs() < 1e-9), "{times:?}");
        assert!((epochs[2].seconds - 0.25).abs() < 1e-9);
        // an epoch's mean loss and gradient norm and its largest peak
        let step = |epoch: f64, loss: f32, grad_norm: f32, peak: u64| StepRecord {
            epoch,
            loss,
            grad_norm,
            rank_peak_bytes: vec![PeakRow::from([0, 0, 0, 0, 0, peak])],
            ..StepRecord::default()
        };
        let h = [
            step(0.5, 2.0, 1.0, 7),
            step(1.0, 4.0, 3.0, 9),
            step(1.5, 1.0, 0.5, 8),
        ];
        let epochs = EpochPoint::of(&h);
        let means = |p: &EpochPoint| (p.mean_loss, p.mean_grad_norm, p.peak_bytes);
        assert_eq!(
            epochs.iter().map(means).collect::<Vec<_>>(),
            [(3.0, 2.0, 9), (1.0, 0.5, 8)]
        );
        // a step that reads more than an epoch leaves the one it skips out
        let h = [step(2.5, 1.0, 1.0, 1), step(5.0, 1.0, 1.0, 1)];
        let epochs: Vec<usize> = EpochPoint::of(&h).iter().map(|p| p.epoch).collect();
        assert_eq!(epochs, [1, 3]);
    }

    /// A cell is skipped for what a run refuses before its first step: the
    /// interleaved schedule sends micro-batches through its 2 stages in
    /// pairs, so one micro-batch a step is a skipped cell, not a matrix
    /// that ends at it (`compare --task classify` left the check out).
    #[test]
    fn cells_are_skipped_for_every_rule_a_run_checks_first() {
        let bert = crate::model::bert::BertConfig::preset("bert-minilm").unwrap();
        let model = ModelConfig::from(bert);
        let layouts = [Layout::Single, Layout::Interleaved];
        let at = |grad_accum| layout_cells("m", &layouts, &[2], &[4], &model, grad_accum);
        let (cells, skipped) = at(1);
        assert_eq!(cells.len(), 1, "{skipped:?}");
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        let said = &skipped[0];
        assert!(
            said.contains("interleaved x2 batch 4") && said.contains("multiple of 2"),
            "{said}"
        );
        let (cells, skipped) = at(2);
        assert_eq!((cells.len(), skipped.len()), (2, 0), "{skipped:?}");
        // one rank of a parallel strategy is single's run: said, not dropped
        let (cells, skipped) = layout_cells("m", &layouts, &[1], &[4], &model, 2);
        assert_eq!(cells.len(), 1, "{skipped:?}");
        assert!(
            skipped.len() == 1 && skipped[0].contains("m interleaved x1: one rank"),
            "{skipped:?}"
        );
    }

    /// A step time is the mean of the steps after the first, or the first's
    /// where the run has one step (a one-step classifier run said 0 ms).
    #[test]
    fn a_runs_step_time_leaves_out_its_first_step_unless_it_is_the_only_one() {
        let steps = |ms: &[f64]| -> Vec<StepRecord> {
            ms.iter()
                .map(|&ms| StepRecord {
                    ms,
                    ..Default::default()
                })
                .collect()
        };
        assert_eq!(mean_step_ms(&steps(&[900.0, 10.0, 20.0])), 15.0);
        assert_eq!(mean_step_ms(&steps(&[900.0])), 900.0);
        assert_eq!(mean_step_ms(&[]), 0.0);
    }

    /// A run's folder names its model, strategy, world, tp and batch, and
    /// its pipeline and repeat where it has them: no two runs of a matrix
    /// share one (each run replaces what its folder held).
    #[test]
    fn each_runs_folder_names_what_sets_it_apart() {
        let cell = |parallel| Cell {
            model_name: "tiny".into(),
            model: GptConfig::preset("tiny").unwrap().into(),
            parallel,
            batch: 8,
        };
        let single = cell(ParallelConfig::single());
        assert_eq!(run_name(&single, 0, 1), "tiny-single-x1-tp1-b8");
        assert_eq!(run_name(&single, 1, 3), "tiny-single-x1-tp1-b8-r2");
        let piped = cell(ParallelConfig {
            world_size: 4,
            tp: 2,
            pipeline: Pipeline::new(2, Schedule::GPipe, 1),
            ..ParallelConfig::single()
        });
        assert_eq!(run_name(&piped, 0, 1), "tiny-single-x4-tp2-b8-pp2-gpipe");
    }

    /// A row's tokens/s is the median of its repeats' (the figures'),
    /// also with an even count of repeats: steps of 1 and 3 ms at 1,000
    /// tokens are 1,000,000 and 333,333 tokens/s, median 666,667 (the
    /// rate of the median step, 2 ms, is 500,000).
    #[test]
    fn a_rows_rate_is_the_median_of_its_repeats_rates() {
        let cell = Cell {
            model_name: "tiny".into(),
            model: GptConfig::preset("tiny").unwrap().into(),
            parallel: ParallelConfig::single(),
            batch: 10,
        };
        let repeat = |ms: f64| TrainSummary {
            losses: vec![1.0; 2],
            history: vec![
                StepRecord {
                    ms,
                    ..Default::default()
                };
                2
            ],
            ..Default::default()
        };
        let row = RunResult::from_summaries(&cell, 100, 1, &[repeat(1.0), repeat(3.0)]);
        let want = (1e6 + 1e6 / 3.0) / 2.0;
        assert!(
            (row.tokens_per_s - want).abs() < 1e-6,
            "{}",
            row.tokens_per_s
        );
        assert_eq!(row.tokens_per_s, row.tokens_per_s_spread().median);
        assert!((row.tokens_per_s_per_rank - want).abs() < 1e-6);
    }

    /// A matrix of one world and batch, of `duration`, at `grad_accum`.
    fn one_cell_spec(duration: Duration, grad_accum: usize) -> CompareSpec {
        CompareSpec {
            models: Vec::new(),
            layouts: Vec::new(),
            world_sizes: vec![1],
            batch_sizes: vec![4],
            seq_len: 8,
            grad_accum,
            duration,
            lr: 1e-3,
            seed: 0,
            eval_batches: 1,
            out_dir: PathBuf::new(),
            threads: 1,
            predict: true,
            repeats: 1,
            announce_estimate: true,
        }
    }

    fn tiny_cell(batch: usize) -> Cell {
        Cell {
            model_name: "tiny".into(),
            model: GptConfig::preset("tiny").unwrap().into(),
            parallel: ParallelConfig::single(),
            batch,
        }
    }

    /// The estimate counts a run's steps as the run does, `--grad-accum`
    /// micro-batches a step (plan's step time prices them all): 2 epochs
    /// of 15 batches at 2 micro-batches a step are 15 steps of 100 ms.
    #[test]
    fn the_time_estimate_counts_steps_of_every_micro_batch() {
        let spec = one_cell_spec(Duration::Epochs(2.0), 2);
        let predicted = Predicted {
            peak_bytes: 0.0,
            step_ms: 100.0,
        };
        let secs = estimate_s(&spec, 60, &[tiny_cell(4)], &[predicted]);
        assert!((secs - 1.5).abs() < 1e-9, "{secs} s");
    }

    /// A cell's run trains with the matrix's settings at the cell's batch
    /// (a run at the default batch would match single as well, unseen),
    /// into its own folder, which a rerun replaces. (Its progress bar, set
    /// in `run`, draws only on a terminal: no output a test reads shows it.)
    // mutant-equivalent: src/compare/mod.rs: delete field progress from struct TrainConfig expression in run
    #[test]
    fn a_cells_run_trains_at_its_batch_with_the_matrixs_settings() {
        let spec = CompareSpec {
            seq_len: 24,
            lr: 7e-4,
            seed: 5,
            eval_batches: 3,
            repeats: 2,
            out_dir: PathBuf::from("report"),
            ..one_cell_spec(Duration::Steps(17), 3)
        };
        let cell = tiny_cell(12);
        let cfg = run_config(&spec, &cell, 1);
        assert_eq!(
            (cfg.batch_size, cfg.seq_len, cfg.grad_accum, cfg.seed),
            (12, 24, 3, 5)
        );
        assert!(matches!(cfg.duration, Duration::Steps(17)));
        assert_eq!(
            (cfg.lr, cfg.min_lr, cfg.warmup_steps),
            (7e-4, 7e-4 / 10.0, 10)
        );
        assert_eq!((cfg.eval_batches, cfg.sample_tokens), (3, 0));
        assert!(cfg.overwrite);
        let folder = PathBuf::from("report/runs").join(run_name(&cell, 1, 2));
        assert_eq!(cfg.out_dir, folder);
    }

    #[test]
    fn spread_is_the_median_and_range_of_the_repeats() {
        let s = Spread::of([30.0, 10.0, 20.0]);
        assert_eq!((s.median, s.min, s.max), (20.0, 10.0, 30.0));
        assert_eq!(Spread::of([4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(Spread::of([5.0]).range_percent(), 0.0);
        assert!((s.range_percent() - 100.0).abs() < 1e-12);
        assert!(Spread::of([]).median.is_nan());
    }
}
