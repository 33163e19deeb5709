//! Measures this CPU for the cost model: matmul peak, the efficiency a
//! training step reaches, the AdamW update's memory bandwidth and the
//! thread-rank collectives' bandwidth and latency.

use super::{Device, Network, Precision};
use crate::backend::cpu::{AdamWStep, Cpu};
use crate::backend::Backend;
use crate::error::Result;
use crate::model::GptConfig;
use crate::parallel::{launch, ParallelConfig, StrategyKind};
use crate::train::bench::{bench_rank, BenchSpec};
use serde::Serialize;
use std::time::{Duration, Instant};

/// What the calibration measured.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub peak_flops: f64,
    /// Model FLOPs of a step over the peak, optimizer time taken out.
    pub efficiency: f64,
    /// Bytes/s the AdamW update streams.
    pub memory_bandwidth: f64,
    /// Bytes/s of a 2-rank all-reduce, counted as a ring's 2(N-1)/N.
    pub comm_bandwidth: f64,
    pub comm_latency_s: f64,
    /// The model the efficiency was measured on, and its batch.
    pub model: GptConfig,
    pub batch: usize,
    pub seq_len: usize,
}

impl Calibration {
    /// This machine as a shared device for thread ranks.
    pub fn device(&self, memory_bytes: f64) -> Device {
        Device {
            name: "this CPU".into(),
            peak_flops: self.peak_flops,
            efficiency: self.efficiency,
            memory_bytes,
            memory_bandwidth: self.memory_bandwidth,
            shared_by_ranks: true,
        }
    }

    /// Thread ranks exchange through shared memory: one node.
    pub fn network(&self) -> Network {
        Network {
            ranks_per_node: usize::MAX,
            intra_bandwidth: self.comm_bandwidth,
            intra_latency_s: self.comm_latency_s,
            inter_bandwidth: self.comm_bandwidth,
            inter_latency_s: self.comm_latency_s,
        }
    }
}

/// Streams an AdamW update over `n` parameters a few times; bytes/s.
fn adamw_bandwidth(be: &Cpu, n: usize) -> f64 {
    let mut p = vec![0.1f32; n];
    let g = vec![0.01f32; n];
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
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
        be.adamw(&mut p, &g, &mut m, &mut v, s, 0.1);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&p);
    n as f64 * Precision::Fp32.update_traffic_bytes() / best
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

/// Calibrates on `model` (a GPT-2-small-sized stand-in when it is larger)
/// at `batch` x `seq_len` on one rank with `threads` threads.
pub fn calibrate_cpu(
    model: &GptConfig,
    batch: usize,
    seq_len: usize,
    threads: usize,
) -> Result<Calibration> {
    let be = Cpu::new();
    let peak_flops = be.measure_peak_flops();
    let memory_bandwidth = adamw_bandwidth(&be, 16 << 20);
    let (comm_bandwidth, comm_latency_s) = local_comm(threads)?;
    let gpt2 = GptConfig::preset("gpt2")?;
    let (model, batch, seq_len) = if model.num_params() > gpt2.num_params() {
        (gpt2, 4, 128)
    } else {
        (model.clone(), batch, seq_len)
    };
    let par = ParallelConfig {
        strategy: StrategyKind::Single,
        world_size: 1,
        tp: 1,
        recompute: false,
    };
    // Small models are timed over more steps: their steps are short and noisy.
    let small = model.num_params() <= 20_000_000;
    let spec = BenchSpec {
        batch,
        seq_len,
        warmup: if small { 2 } else { 1 },
        steps: if small { 5 } else { 2 },
        show: false,
    };
    let ranks = launch::run_local(1, threads, Duration::from_secs(600), |c| {
        bench_rank(Cpu::new(), &model, par, spec, c.as_ref())
    })?;
    let step_s = ranks[0][0].step_s;
    let optimizer_s =
        model.num_params() as f64 * Precision::Fp32.update_traffic_bytes() / memory_bandwidth;
    let flops = model.flops_per_token(seq_len) * (batch * seq_len) as f64;
    let efficiency = flops / (peak_flops * (step_s - optimizer_s).max(step_s * 0.1));
    Ok(Calibration {
        peak_flops,
        efficiency,
        memory_bandwidth,
        comm_bandwidth,
        comm_latency_s,
        model,
        batch,
        seq_len,
    })
}
