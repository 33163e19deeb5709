//! Measures this CPU for the cost model: matmul peak, the efficiency a
//! training step reaches, the AdamW update's memory bandwidth and the
//! thread-rank collectives' bandwidth and latency.

use super::{Device, Network, Precision};
use crate::backend::cpu::{AdamWStep, Cpu};
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
            peak_flops: be.measure_peak_flops(),
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
        }
    }
}

/// The step efficiency of one rank of `ranks` sharing this machine.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub machine: Machine,
    /// Model FLOPs of a rank's step over its share of the peak, optimizer time taken out.
    pub efficiency: f64,
    pub ranks: usize,
    /// The model the efficiency was measured on, and the global batch.
    pub model: ModelConfig,
    pub batch: usize,
    pub seq_len: usize,
}

impl Calibration {
    /// This machine as a device shared by its thread ranks.
    pub fn device(&self, memory_bytes: f64) -> Device {
        Device {
            name: "this CPU".into(),
            peak_flops: self.machine.peak_flops,
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
        be.adamw(AdamWUpdate {
            param: p.d(),
            grad: g.s(),
            m: m.d(),
            v: v.d(),
            step: s,
            weight_decay: 0.1,
        });
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

/// Measures the step efficiency of one of `ranks` thread ranks training
/// `model` (a GPT-2-small-sized stand-in when it is larger) at a global
/// `batch` x `seq_len`: independent single-rank steps, each with its share
/// of the threads and of the batch, run side by side; the time is stretched
/// when ranks outnumber threads.
pub fn calibrate_cpu(
    machine: &Machine,
    model: &ModelConfig,
    batch: usize,
    seq_len: usize,
    ranks: usize,
) -> Result<Calibration> {
    let gpt2 = ModelConfig::preset("gpt2")?;
    let (model, batch, seq_len) = if model.num_params() > gpt2.num_params() {
        (gpt2, 4 * ranks, 128)
    } else {
        (model.clone(), batch, seq_len)
    };
    let rank_batch = (batch / ranks).max(1);
    let rank_threads = (machine.threads / ranks).max(1);
    let oversubscribed = (ranks as f64 / machine.threads as f64).max(1.0);
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
    };
    // Every rank runs at once, each on its own, so they contend for memory
    // and caches as the real ranks do; no collective is involved. When ranks
    // outnumber threads, as many run at once as there are threads.
    let concurrent = ranks.min(machine.threads);
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
    let step_s = mean_s * oversubscribed;
    // the update streams at this rank's share of the bandwidth
    let optimizer_s = model.num_params() as f64 * Precision::Fp32.update_traffic_bytes()
        / (machine.memory_bandwidth / ranks as f64);
    let flops = model.flops_per_token(seq_len) * (rank_batch * seq_len) as f64;
    let share = machine.peak_flops / ranks as f64;
    let efficiency = flops / (share * (step_s - optimizer_s).max(step_s * 0.1));
    Ok(Calibration {
        machine: machine.clone(),
        efficiency,
        ranks,
        model,
        batch,
        seq_len,
    })
}
