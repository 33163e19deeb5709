//! `distgpt bench`: training throughput, MFU and peak memory per category on
//! synthetic tokens, in the shape `bench/pytorch_reference.py` mirrors.

use super::ModelArgs;
use anyhow::Result;
use clap::Args;
use distgpt::backend::cpu::Cpu;
use distgpt::backend::Backend;
use distgpt::data::Batch;
use distgpt::metrics;
use distgpt::model::{AdamWConfig, Gpt2};
use distgpt::parallel::{Single, StepConfig, Strategy};
use distgpt::rng::Rng;
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Vocabulary size (default: the preset's; 65 for the char presets).
    #[arg(long)]
    vocab_size: Option<usize>,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Timed optimizer steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Declared peak GFLOP/s for MFU (default: measured).
    #[arg(long)]
    peak_gflops: Option<f64>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    let cfg = a.model.resolve(a.vocab_size)?;
    let (b, t) = (a.batch_size, a.seq_len.unwrap_or(cfg.block_size));
    let backend = Cpu::new();
    let peak = a
        .peak_gflops
        .map_or_else(|| backend.measure_peak_flops(), |g| g * 1e9);
    let mut model = Gpt2::new(backend.clone(), cfg.clone())?;
    model.init_weights(1);
    let mut strategy = Single::new(model, AdamWConfig::default(), b, t);
    let mut rng = Rng::new(7);
    let mut batch = || {
        let mut ids = || {
            (0..b * t)
                .map(|_| rng.below(cfg.vocab_size) as u32)
                .collect::<Vec<_>>()
        };
        Batch {
            inputs: ids(),
            targets: ids(),
        }
    };
    let step_cfg = StepConfig {
        lr: 1e-4,
        grad_clip: 1.0,
    };
    let pb = if a.json {
        indicatif::ProgressBar::hidden()
    } else {
        metrics::progress_bar((a.warmup + a.steps) as u64, "bench")
    };
    let mut times = Vec::new();
    for i in 0..a.warmup + a.steps {
        let mb = [batch()];
        let t0 = Instant::now();
        strategy.step(&mb, step_cfg)?;
        if i >= a.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let mean_s = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let tokens_per_s = (b * t) as f64 / mean_s;
    let mfu = metrics::mfu(cfg.flops_per_token(t), tokens_per_s, peak);
    let mem = strategy.memory();
    if a.json {
        let j = serde_json::json!({
            "impl": "distgpt", "model": a.model.model_name(), "params": cfg.num_params(), "batch": b, "seq": t,
            "threads": rayon::current_num_threads(), "ms_per_step": mean_s * 1e3, "tokens_per_s": tokens_per_s,
            "mfu": mfu, "peak_gflops": peak / 1e9, "flops_per_token": cfg.flops_per_token(t), "memory": mem,
        });
        println!("{j}");
    } else {
        println!(
            "distgpt {} ({} params) batch {b} x {t}, {} threads: {:.1} ms/step, {:.0} tokens/s, MFU {:.1}% of {:.0} GFLOP/s",
            a.model.model_name(),
            cfg.num_params(),
            rayon::current_num_threads(),
            mean_s * 1e3,
            tokens_per_s,
            100.0 * mfu,
            peak / 1e9
        );
        println!("peak memory: {}", metrics::memory_line(&mem));
    }
    Ok(())
}
