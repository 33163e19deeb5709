//! Measures this CPU for the cost model: matmul peak, the efficiency a
//! training step reaches, the AdamW update's memory bandwidth and the
//! thread-rank collectives' bandwidth and latency.

use super::{Device, Network, Precision};
use crate::backend::cpu::Cpu;
use crate::backend::AdamWStep;
use crate::backend::{AdamWUpdate, Buf, Category, Device as _, Kernels as _};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::parallel::{launch, ParallelConfig};
use crate::train::bench::{bench_rank, BenchSpec};
use serde::Serialize;
use std::time::{Duration, Instant};

/// This machine's speeds, measured once.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub threads: usize,
    pub peak_flops: f64,
    /// Bytes/s the AdamW update streams.
    pub memory_bandwidth: f64,
    /// Bytes/s of a 2-rank all-reduce, counted as a ring's 2(N-1)/N.
    pub comm_bandwidth: f64,
    pub comm_latency_s: f64,
}

impl Machine {
    /// Matmul peak, AdamW bandwidth and thread-rank all-reduce with `threads` threads.
    pub fn measure(threads: usize) -> Result<Machine> {
        let be = Cpu::new();
        let (comm_bandwidth, comm_latency_s) = local_comm(threads)?;
        Ok(Machine {
            threads,
            peak_flops: crate::metrics::peak::measure(&be).flops,
            memory_bandwidth: adamw_bandwidth(&be, 16 << 20)?,
            comm_bandwidth,
            comm_latency_s,
        })
    }

    /// Thread ranks exchange through shared memory: one node.
    pub fn network(&self) -> Network {
        Network {
            ranks_per_node: usize::MAX,
            intra_bandwidth: self.comm_bandwidth,
            intra_latency_s: self.comm_latency_s,
            inter_bandwidth: self.comm_bandwidth,
            inter_latency_s: self.comm_latency_s,
            // no device to offload from: host memory is the ranks' own
            pcie_bandwidth: self.memory_bandwidth,
            host_bandwidth: self.memory_bandwidth,
            host_memory_bytes: f64::INFINITY,
        }
    }
}

/// The step efficiency of one rank of `ranks` sharing this machine.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub machine: Machine,
    /// Model FLOPs of a rank's step over its share of the peak, optimizer time taken out.
    pub efficiency: f64,
    /// The matmul peak of the CPUs the ranks' threads run on (the
    /// machine's, measured on its threads, scaled to as many CPUs).
    pub peak_flops: f64,
    pub ranks: usize,
    /// The model and global batch asked about.
    pub model: ModelConfig,
    pub batch: usize,
    pub seq_len: usize,
    /// What was timed: the model (fewer blocks where the asked one's step
    /// is large) and one rank's batch and sequence length.
    pub measured: (ModelConfig, usize, usize),
}

impl Calibration {
    /// This machine as a device shared by its thread ranks.
    pub fn device(&self, memory_bytes: f64) -> Device {
        Device {
            name: "this CPU".into(),
            peak_flops: self.peak_flops,
            efficiency: self.efficiency,
            memory_bytes,
            memory_bandwidth: self.machine.memory_bandwidth,
            shared_by_ranks: true,
        }
    }
}

/// Streams an AdamW update over `n` parameters a few times; bytes/s.
fn adamw_bandwidth(be: &Cpu, n: usize) -> Result<f64> {
    let alloc = |x: f32| -> Result<Buf<Cpu>> {
        let mut b = be.alloc(n, Category::Other)?;
        be.fill(b.d(), x);
        Ok(b)
    };
    let (mut p, g, mut m, mut v) = (alloc(0.1)?, alloc(0.01)?, alloc(0.0)?, alloc(0.0)?);
    let mut best = f64::INFINITY;
    for step in 1..=4 {
        let t0 = Instant::now();
        let s = AdamWStep {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            step,
            grad_scale: 1.0,
        };
        be.run(AdamWUpdate {
            param: p.d(),
            grad: g.s(),
            m: m.d(),
            v: v.d(),
            copy: None,
            step: s,
            weight_decay: 0.1,
        })?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&p);
    Ok(n as f64 * Precision::Fp32.update_traffic_bytes() / best)
}

/// (bytes/s, latency s) of all-reduces between two thread ranks.
fn local_comm(threads: usize) -> Result<(f64, f64)> {
    let big = 4 << 20;
    let out = launch::run_local(2, threads, Duration::from_secs(60), |c| {
        let mut x = vec![1.0f32; big];
        let mut best = f64::INFINITY;
        for _ in 0..4 {
            c.barrier()?;
            let t0 = Instant::now();
            c.all_reduce(&mut x)?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let mut one = [1.0f32];
        c.barrier()?;
        let t0 = Instant::now();
        let reps = 200;
        for _ in 0..reps {
            c.all_reduce(&mut one)?;
        }
        Ok((best, t0.elapsed().as_secs_f64() / reps as f64))
    })?;
    let (big_s, small_s) = out[0];
    // ring all-reduce over 2 ranks: 2(N-1)/N = 1 buffer per rank, 2 hops
    Ok(((big * 4) as f64 / big_s, small_s / 2.0))
}

/// The most model FLOPs a calibration step may take (about a second on 2
/// cores): a larger rank step is timed on a smaller shape of it.
const STEP_FLOPS: f64 = 50e9;

/// The shape a rank's calibration step runs at: the asked one, or, while
/// its step is over [`STEP_FLOPS`] or `concurrent` of them would take more
/// than half the available memory, one row, then shorter sequences and
/// two blocks (the efficiency of the same widths, scaled to the model).
fn calibration_shape(
    model: &ModelConfig,
    rank_batch: usize,
    seq_len: usize,
    concurrent: usize,
) -> Result<(ModelConfig, usize, usize)> {
    let bytes = |m: &ModelConfig, b: usize, t: usize| {
        let w = super::Workload {
            model: m.clone(),
            batch: b,
            seq_len: t,
            grad_accum: 1,
            cpu_threads: None,
        };
        super::memory_plan(&w, ParallelConfig::single(), Precision::Fp32).total()
            * concurrent as f64
    };
    let room = crate::metrics::available_memory_bytes().map_or(f64::INFINITY, |a| a as f64 / 2.0);
    let fits = |m: &ModelConfig, b: usize, t: usize| {
        m.flops_per_token(t) * (b * t) as f64 <= STEP_FLOPS && bytes(m, b, t) <= room
    };
    let mut shape = (model.clone(), rank_batch, seq_len);
    let smaller = [
        |(m, _, t): (ModelConfig, usize, usize)| (m, 1, t),
        |(m, b, t): (ModelConfig, usize, usize)| (m, b, t.min(256)),
        |(m, b, t): (ModelConfig, usize, usize)| (m.with_layers(2).unwrap_or(m), b, t),
        |(m, b, t): (ModelConfig, usize, usize)| (m, b, t.min(128)),
        |(m, b, t): (ModelConfig, usize, usize)| (m, b, t.min(64)),
    ];
    for shrink in smaller {
        if fits(&shape.0, shape.1, shape.2) {
            break;
        }
        shape = shrink(shape);
    }
    let need = bytes(&shape.0, shape.1, shape.2);
    if need > room {
        return Err(crate::error::Error::Config(format!(
            "calibrating this CPU needs {:.1} GB for {concurrent} rank steps, and it keeps within \
             half of the {:.1} GB available (the rest is the system's): pass --efficiency to \
             skip the calibration",
            need / 1e9,
            2.0 * room / 1e9
        )));
    }
    Ok(shape)
}

/// Measures the step efficiency of one of `ranks` thread ranks training
/// `model` at a global `batch` x `seq_len`: independent single-rank steps,
/// each with its share of the threads and of the batch, run side by side;
/// the time is stretched when ranks outnumber threads. A large rank step
/// is timed on a smaller shape (`calibration_shape`); what runs and
/// about how long it takes is said first, on stderr.
pub fn calibrate_cpu(
    machine: &Machine,
    asked: &ModelConfig,
    asked_batch: usize,
    asked_seq: usize,
    ranks: usize,
) -> Result<Calibration> {
    let side = SideBySide::of(ranks, machine.threads, launch::available_cpus());
    let (concurrent, rank_threads) = (side.concurrent, side.rank_threads);
    let (model, rank_batch, seq_len) =
        calibration_shape(asked, (asked_batch / ranks).max(1), asked_seq, concurrent)?;
    let par = ParallelConfig::single();
    // Small models are timed over more steps: their steps are short and noisy.
    let small = model.num_params() <= 20_000_000;
    let spec = BenchSpec {
        batch: rank_batch,
        grad_accum: 1,
        seq_len,
        warmup: if small { 2 } else { 1 },
        steps: if small { 5 } else { 2 },
        show: false,
        profile: false,
    };
    // Ranks run at once, each on its own, so they contend for memory and
    // caches as the real ranks do; no collective is involved.
    let step_flops = model.flops_per_token(seq_len) * (rank_batch * seq_len) as f64;
    let rank_peak = machine.peak_flops / concurrent as f64;
    crate::errln!(
        "  calibrating {}: {concurrent} x {} steps of {} ({} params) at {rank_batch} x {seq_len} \
         tokens side by side, about {:.0} s",
        crate::metrics::count(ranks, "rank"),
        spec.warmup + spec.steps,
        if model == *asked {
            "the model".to_string()
        } else {
            format!("{} blocks of the model", model.n_layer())
        },
        model.num_params(),
        // at half the matmul peak, plus building the model
        (spec.warmup + spec.steps) as f64 * step_flops / (0.5 * rank_peak) + 1.0
    );
    let times: Vec<Result<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..concurrent)
            .map(|_| {
                s.spawn(|| {
                    launch::run_local(1, rank_threads, Duration::from_secs(600), |c| {
                        bench_rank(Cpu::new(), &model, par, spec, c.as_ref())
                    })
                    .map(|out| out[0][0].step_s)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("calibration thread"))
            .collect()
    });
    let mut mean_s = 0.0;
    for t in times {
        mean_s += t? / concurrent as f64;
    }
    let (efficiency, peak_flops) =
        side.efficiency(machine, ranks, &model, rank_batch, seq_len, mean_s);
    Ok(Calibration {
        machine: machine.clone(),
        efficiency,
        peak_flops,
        ranks,
        measured: (model, rank_batch, seq_len),
        model: asked.clone(),
        batch: asked_batch,
        seq_len: asked_seq,
    })
}

/// How a calibration runs `ranks` thread ranks of a run with `threads`
/// threads on `cpus` CPUs: each rank on the threads the run gives it (at
/// least one: `launch::rank_threads`), as many side by side as the CPUs
/// hold, and the time stretched by as much more as the run's threads
/// outnumber the CPUs (they time-share them); the peak they share is the
/// machine's (measured on `threads`) scaled to the CPUs they use.
#[derive(Debug, PartialEq)]
struct SideBySide {
    concurrent: usize,
    rank_threads: usize,
    stretch: f64,
    peak_scale: f64,
}

impl SideBySide {
    fn of(ranks: usize, threads: usize, cpus: usize) -> Self {
        let rank_threads = launch::rank_threads(threads, ranks);
        let concurrent = ranks.min((cpus / rank_threads).max(1));
        // `n` ranks' threads (the run's each) against the CPUs
        let shared = |n: usize| ((n * rank_threads) as f64 / cpus as f64).max(1.0);
        let used = |threads: usize| threads.min(cpus) as f64;
        SideBySide {
            concurrent,
            rank_threads,
            stretch: shared(ranks) / shared(concurrent),
            peak_scale: used(launch::ranks_threads(threads, ranks)) / used(threads),
        }
    }

    /// The step efficiency of one of `ranks` ranks whose steps of `batch`
    /// x `seq_len` tokens took `mean_s` side by side, and the peak the ranks share: the
    /// model's FLOPs over its share of that peak and the step stretched,
    /// less the AdamW update (at its share of the bandwidth).
    fn efficiency(
        &self,
        machine: &Machine,
        ranks: usize,
        model: &ModelConfig,
        batch: usize,
        seq_len: usize,
        mean_s: f64,
    ) -> (f64, f64) {
        let step_s = mean_s * self.stretch;
        let optimizer_s = model.num_params() as f64 * Precision::Fp32.update_traffic_bytes()
            / (machine.memory_bandwidth / ranks as f64);
        let flops = model.flops_per_token(seq_len) * (batch * seq_len) as f64;
        let peak_flops = machine.peak_flops * self.peak_scale;
        let share = peak_flops / ranks as f64;
        (
            flops / (share * (step_s - optimizer_s).max(step_s * 0.1)),
            peak_flops,
        )
    }
}

/// The efficiency a training run reached: the median of its logged steps'
/// MFU (against the hardware peak the run divided by), the first step left
/// out as warm-up. `plan --efficiency-from RUN` prices a device at it, so a
/// step distgpt measured on a GPU (`scripts/gpu_check.sh`) stands in for
/// the assumed 0.4 of peak.
#[derive(Clone, Debug, Serialize)]
pub struct RunEfficiency {
    pub efficiency: f64,
    /// The steps the median is over.
    pub steps: usize,
    /// What the run trained on (`cpu`, `opencl`, `cuda`).
    pub device: String,
    pub peak_flops: f64,
}

/// Reads a run directory's [`RunEfficiency`].
pub fn run_efficiency(dir: &std::path::Path) -> Result<RunEfficiency> {
    use crate::error::Error;
    let record = crate::train::run_dir::read_record(dir)?;
    let steps = crate::train::run_dir::read_metrics(dir)?;
    let mfu: Vec<f64> = steps.iter().skip(1).map(|r| r.mfu).collect();
    if mfu.is_empty() {
        return Err(Error::Input(format!(
            "{} logs {}: an efficiency needs two or more (the first is warm-up)",
            dir.display(),
            crate::metrics::count(steps.len(), "step")
        )));
    }
    if let Some(bad) = mfu
        .iter()
        .find(|m| !(m.is_finite() && **m > 0.0 && **m <= 1.0))
    {
        return Err(Error::Input(format!(
            "{} logs an MFU of {bad}: an efficiency is a fraction of the peak in (0, 1]",
            dir.display()
        )));
    }
    Ok(RunEfficiency {
        efficiency: crate::metrics::Spread::of(mfu.iter().copied()).median,
        steps: mfu.len(),
        device: record.device,
        peak_flops: record.peak_flops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large rank step is timed on a smaller shape, within the FLOP
    /// budget; a small one as asked.
    #[test]
    fn a_large_step_is_calibrated_on_a_small_shape() {
        let gpt2 = ModelConfig::preset("gpt2").unwrap();
        let (m, b, t) = calibration_shape(&gpt2, 8, 1024, 2).unwrap();
        assert!(m.flops_per_token(t) * (b * t) as f64 <= STEP_FLOPS);
        assert!(
            (m.n_layer(), b, t) == (2, 1, 128),
            "{} blocks, {b} x {t}",
            m.n_layer()
        );
        let tiny = ModelConfig::preset("tiny").unwrap();
        let (m, b, t) = calibration_shape(&tiny, 4, 32, 2).unwrap();
        assert!(m == tiny && (b, t) == (4, 32));
    }

    /// A rank's efficiency: its FLOPs over its share of the peak the ranks
    /// share, in its step stretched, less the update.
    #[test]
    fn a_ranks_efficiency_is_its_flops_over_its_share_of_the_peak_in_its_step() {
        let tiny = ModelConfig::preset("tiny").unwrap();
        let (params, flops) = (tiny.num_params() as f64, tiny.flops_per_token(32) * 64.0);
        // 4 ranks of --threads 1 on 2 CPUs: 2 side by side, each step twice
        // as long, on twice the peak measured on one thread
        let side = SideBySide::of(4, 1, 2);
        let update = Precision::Fp32.update_traffic_bytes();
        let machine = Machine {
            threads: 1,
            peak_flops: 1e11,
            // the update takes 2 ms at a quarter of it
            memory_bandwidth: params * update * 4.0 / 2e-3,
            comm_bandwidth: 1e9,
            comm_latency_s: 1e-5,
        };
        let (eff, peak) = side.efficiency(&machine, 4, &tiny, 2, 32, 5e-3);
        assert_eq!(peak, 2e11);
        // 10 ms stretched, less 2 ms of update: 8 ms at a quarter of 2e11
        let want = flops / (5e10 * 8e-3);
        assert!((eff - want).abs() < 1e-9 * want, "{eff} vs {want}");
        // a step the update would swallow keeps a tenth of itself
        let (eff, _) = side.efficiency(&machine, 4, &tiny, 2, 32, 1e-3);
        let want = flops / (5e10 * 2e-4);
        assert!((eff - want).abs() < 1e-9 * want, "{eff} vs {want}");
    }

    /// A calibration times one rank's share of the batch and prices the
    /// machine as a device of the peak its ranks' CPUs share.
    #[test]
    fn a_calibration_times_a_ranks_share_of_the_batch() {
        let tiny = ModelConfig::preset("tiny").unwrap();
        let machine = Machine {
            threads: 1,
            peak_flops: 1e11,
            memory_bandwidth: 1e10,
            comm_bandwidth: 1e9,
            comm_latency_s: 1e-5,
        };
        let cal = calibrate_cpu(&machine, &tiny, 8, 32, 2).unwrap();
        assert!(cal.measured == (tiny.clone(), 4, 32), "{:?}", cal.measured);
        // two ranks of a thread each: two CPUs' peak where there are two
        let cpus = launch::available_cpus().min(2) as f64;
        assert_eq!(cal.peak_flops, 1e11 * cpus);
        assert!(cal.efficiency > 0.0 && cal.efficiency.is_finite());
        let d = cal.device(1e9);
        let got = (
            d.peak_flops,
            d.efficiency,
            d.memory_bandwidth,
            d.memory_bytes,
        );
        assert_eq!(got, (cal.peak_flops, cal.efficiency, 1e10, 1e9));
    }

    /// Ranks run side by side on the threads the run gives them, however
    /// few `--threads` are: two ranks of `--threads 1` on 2 CPUs run on
    /// one CPU each, as `train` and `bench` run them, and share both CPUs'
    /// peak (priced as one CPU time-shared until 2026-12-07: the tiny model
    /// 5.9 ms a step where bench took 2.1-3.3).
    #[test]
    fn thread_ranks_are_timed_on_the_threads_a_run_gives_them() {
        let of = |ranks, threads, cpus| {
            let s = SideBySide::of(ranks, threads, cpus);
            (s.concurrent, s.rank_threads, s.stretch, s.peak_scale)
        };
        // (ranks, --threads, CPUs) -> (side by side, threads each, stretch,
        // the peak they share against the one measured on --threads)
        assert_eq!(of(2, 1, 2), (2, 1, 1.0, 2.0));
        assert_eq!(of(4, 1, 2), (2, 1, 2.0, 2.0));
        assert_eq!(of(8, 2, 2), (2, 1, 4.0, 1.0));
        assert_eq!(of(1, 2, 2), (1, 2, 1.0, 1.0));
        assert_eq!(of(8, 2, 16), (8, 1, 1.0, 4.0));
        assert_eq!(of(2, 16, 2), (1, 8, 2.0, 1.0));
        assert_eq!(of(3, 8, 4), (2, 2, 1.5, 1.0));
        // 2 ranks of 2 threads on 3 CPUs: one at a time, 4 threads on 3
        assert_eq!(of(2, 4, 3), (1, 2, 4.0 / 3.0, 1.0));
    }
}
