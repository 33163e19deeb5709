//! Timed optimizer steps on synthetic tokens: what `distgpt bench` reports
//! and what `plan`'s calibration measures, per rank.

use crate::backend::{profile, Backend, PeakRow};
use crate::comm::{Comm, CommStats};
use crate::error::Result;
use crate::metrics;
use crate::model::{AdamWConfig, ModelConfig};
use crate::parallel::{self, pipeline, ParallelConfig, Span, StepConfig, Strategy};
use crate::rng::Rng;
use std::time::Instant;

/// The steps to time.
#[derive(Clone, Copy, Debug)]
pub struct BenchSpec {
    /// Global batch in sequences.
    pub batch: usize,
    /// Micro-batches of `batch` per step (a pipeline's in flight).
    pub grad_accum: usize,
    pub seq_len: usize,
    /// Untimed steps first.
    pub warmup: usize,
    pub steps: usize,
    /// Progress bar on rank 0.
    pub show: bool,
    /// Counts every kernel of the timed steps in the process's profile
    /// (`backend::profile`), for [`crate::backend::profile::Counters::snapshot`] after.
    pub profile: bool,
}

/// What one rank measured.
#[derive(Clone, Debug)]
pub struct RankBench {
    /// Mean seconds of a timed step.
    pub step_s: f64,
    /// Mean seconds of a timed step's optimizer update.
    pub update_s: f64,
    /// Peak bytes.
    pub peak: PeakRow,
    /// Peak bytes in host memory under offload (zeros without).
    pub host_peak: PeakRow,
    /// Bytes sent and seconds spent in collectives, a timed step's mean
    /// (the warm-up's left out, as from `step_s`).
    pub comm_bytes_per_step: f64,
    pub comm_s_per_step: f64,
    /// A pipeline's idle fraction over the timed steps, measured from every
    /// rank's program (`pipeline::measured_bubble`, the mean of the steps'),
    /// the same on every rank; none without a pipeline.
    pub bubble: Option<f64>,
    /// This rank's forwards and backwards in the last timed step.
    pub timeline: Vec<Span>,
    /// The parts this rank ran its batch in (`model::parts`).
    pub parts: usize,
}

/// Runs the steps on this rank; returns every rank's measurements (collective).
pub fn bench_rank<B: Backend + 'static>(
    backend: B,
    cfg: &ModelConfig,
    par: ParallelConfig,
    spec: BenchSpec,
    world: &dyn Comm,
) -> Result<Vec<RankBench>> {
    let (b, t) = (spec.batch, spec.seq_len);
    let mut strategy = parallel::build(
        backend,
        cfg.clone(),
        par,
        world,
        AdamWConfig::default(),
        b,
        t,
    )?;
    strategy.load_full(&cfg.init_full(1))?;
    let mut rng = Rng::new(7);
    let mut batch = || cfg.synthetic_batch(&mut rng, b, t);
    let pb = if spec.show && world.rank() == 0 {
        metrics::progress_bar((spec.warmup + spec.steps) as u64, "bench")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut timed = Timed::default();
    for i in 0..spec.warmup + spec.steps {
        let mb: Vec<_> = (0..spec.grad_accum.max(1)).map(|_| batch()).collect();
        world.barrier()?;
        if spec.profile && i == spec.warmup {
            // every rank of the process is between these barriers: no kernel runs
            profile::PROCESS.start();
            world.barrier()?;
        }
        if i == spec.warmup {
            // the timed steps' collectives, as their time is the timed steps'
            timed.before = strategy.comm_stats();
        }
        let t0 = Instant::now();
        let stats = strategy.step(
            &mb,
            StepConfig {
                lr: 1e-4,
                grad_clip: 1.0,
            },
        )?;
        if i >= spec.warmup {
            timed.total += t0.elapsed().as_secs_f64();
            timed.update += stats.update_s;
            let mine = strategy.timeline();
            if !mine.is_empty() {
                timed.timelines = pipeline::on_one_clock(world.gather(&mine)?);
                timed
                    .bubbles
                    .extend(pipeline::measured_bubble(&timed.timelines));
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    if spec.profile {
        world.barrier()?;
        profile::PROCESS.stop();
    }
    every_rank(strategy.as_ref(), world, spec.steps, timed)
}

/// What this rank's timed steps measured: their seconds and their
/// updates', the collectives' counters before them, and a pipeline's
/// bubbles and last timelines.
#[derive(Default)]
struct Timed {
    total: f64,
    update: f64,
    before: CommStats,
    bubbles: Vec<f64>,
    timelines: Vec<Vec<Span>>,
}

impl Timed {
    /// A rank's figures a step over `steps` timed steps: bytes and seconds
    /// in collectives (the counters `now` less those before the timed
    /// steps), the step's and the update's seconds, and the step's parts.
    fn per_step(&self, now: &CommStats, steps: usize, parts: usize) -> [f64; 5] {
        let c = now.since(&self.before);
        let steps = steps.max(1) as f64;
        [
            c.total_bytes() as f64 / steps,
            c.seconds / steps,
            self.total / steps,
            self.update / steps,
            parts as f64,
        ]
    }
}

/// Every rank's measurements from `steps` timed steps (collective): each
/// rank's peak memory, collectives and times, gathered.
fn every_rank(
    strategy: &dyn Strategy,
    world: &dyn Comm,
    steps: usize,
    timed: Timed,
) -> Result<Vec<RankBench>> {
    let times = timed.per_step(&strategy.comm_stats(), steps, strategy.batch_parts());
    let memory = strategy.memory();
    let host = memory
        .host
        .as_ref()
        .map(|h| h.peak_row())
        .unwrap_or_default();
    let peak: Vec<u64> = <[u64; PeakRow::LEN]>::from(memory.peak_row())
        .into_iter()
        .chain(<[u64; PeakRow::LEN]>::from(host))
        .collect();
    let mut all_peaks = vec![0u64; peak.len() * world.size()];
    world.all_gather(&peak, &mut all_peaks)?;
    let mut all_times = vec![0f64; times.len() * world.size()];
    world.all_gather(&times, &mut all_times)?;
    let bubbles = &timed.bubbles;
    let bubble = (!bubbles.is_empty()).then(|| bubbles.iter().sum::<f64>() / bubbles.len() as f64);
    let mut timelines = timed.timelines;
    timelines.resize(world.size(), Vec::new());
    Ok(all_peaks
        .chunks(peak.len())
        .zip(all_times.chunks(times.len()))
        .zip(timelines)
        .map(|((p, t), timeline)| {
            let peaks = PeakRow::rows(p);
            RankBench {
                peak: peaks[0],
                host_peak: peaks[1],
                comm_bytes_per_step: t[0],
                comm_s_per_step: t[1],
                step_s: t[2],
                update_s: t[3],
                parts: t[4] as usize,
                bubble,
                timeline,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each figure is the timed steps' total over their count, the
    /// collectives' less what was counted before the first timed step.
    #[test]
    fn a_ranks_figures_a_step_are_the_timed_steps_totals_over_their_count() {
        let counters = |bytes, seconds| CommStats {
            all_reduce_bytes: bytes,
            p2p_bytes: 8,
            seconds,
            ..CommStats::default()
        };
        let timed = Timed {
            total: 5.0,
            update: 1.5,
            before: counters(100, 1.0),
            ..Timed::default()
        };
        let got = timed.per_step(&counters(500, 3.5), 4, 3);
        assert_eq!(got, [100.0, 0.625, 1.25, 0.375, 3.0]);
    }
}
