//! The training loop: data -> strategy step -> metrics, evaluation, samples,
//! and the weights written to the run directory at the end.

pub mod schedule;

use crate::backend::{Backend, MemoryReport};
use crate::checkpoint;
use crate::data::{DataLoader, Dataset, LoaderPosition};
use crate::error::{Error, Result};
use crate::infer::generate::{generate, SampleConfig};
use crate::metrics::{self, JsonlWriter, StepRecord};
use crate::model::{AdamWConfig, Gpt2, GptConfig};
use crate::parallel::{Single, StepConfig, Strategy};
use schedule::LrSchedule;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// How long to train.
#[derive(Clone, Copy, Debug, Serialize)]
pub enum Duration {
    Steps(usize),
    Epochs(f64),
}

#[derive(Clone, Debug, Serialize)]
pub struct TrainConfig {
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    pub duration: Duration,
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_steps: usize,
    pub adamw: AdamWConfig,
    pub grad_clip: f32,
    /// Evaluate every N steps (and at the end); 0: only at the end.
    pub eval_every: usize,
    pub eval_batches: usize,
    /// Print a sample every N steps; 0: only at the end.
    pub sample_every: usize,
    pub sample_tokens: usize,
    pub seed: u64,
    pub out_dir: PathBuf,
    /// Declared peak FLOP/s for MFU; measured when absent.
    pub peak_flops: Option<f64>,
    /// Progress bar and messages on stderr.
    pub verbose: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub steps: usize,
    pub first_loss: f32,
    pub final_loss: f32,
    pub val_loss: f32,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub seconds: f64,
    pub memory: MemoryReport,
    pub sample: String,
    pub out_dir: PathBuf,
}

/// Mean validation loss over the first `n` batches of the val split.
fn evaluate<S: Strategy>(strategy: &mut S, val: &mut DataLoader, n: usize) -> Result<f32> {
    val.seek(LoaderPosition::default());
    let n = n.clamp(1, val.batches_per_epoch());
    let mut sum = 0.0f64;
    for _ in 0..n {
        sum += strategy.eval_loss(&val.next_batch())? as f64;
    }
    Ok((sum / n as f64) as f32)
}

fn sample_text<B: Backend>(
    model: &mut Gpt2<B>,
    ds: &Dataset,
    tokens: usize,
    seed: u64,
) -> Result<String> {
    let tk = &ds.tokenizer;
    let prompt = match tk.eot() {
        Some(eot) => vec![eot],
        None => tk.encode("\n").unwrap_or_else(|_| vec![0]),
    };
    let cfg = SampleConfig {
        max_new_tokens: tokens,
        temperature: 0.8,
        top_k: 40,
        seed,
    };
    let out = generate(model, &prompt, &cfg, tk.eot(), |_| {})?;
    Ok(tk.decode(&out[prompt.len()..]))
}

/// Trains a freshly initialised model of `model_cfg` on `ds` with one rank.
pub fn train<B: Backend>(
    backend: B,
    model_cfg: GptConfig,
    ds: &Dataset,
    cfg: &TrainConfig,
) -> Result<TrainSummary> {
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    if b == 0 || cfg.grad_accum == 0 {
        return Err(Error::Config(
            "batch size and gradient accumulation must be at least 1".into(),
        ));
    }
    if t == 0 || t > model_cfg.block_size {
        return Err(Error::Config(format!(
            "sequence length {t} must be between 1 and the model's block size {}",
            model_cfg.block_size
        )));
    }
    let mut train_loader = DataLoader::new(&ds.train, "train", b, t, cfg.seed, true)?;
    let mut val_loader = DataLoader::new(&ds.val, "val", b, t, cfg.seed, false)?;
    let steps = match cfg.duration {
        Duration::Steps(n) => n,
        Duration::Epochs(e) => {
            ((e * train_loader.batches_per_epoch() as f64) / cfg.grad_accum as f64).ceil() as usize
        }
    }
    .max(1);
    let sched = LrSchedule {
        max_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: steps,
    };
    let peak_flops = cfg
        .peak_flops
        .unwrap_or_else(|| backend.measure_peak_flops());
    let device = backend.name();

    let mut model = Gpt2::new(backend, model_cfg.clone())?;
    model.init_weights(cfg.seed);
    let mut strategy = Single::new(model, cfg.adamw, b, t);

    std::fs::create_dir_all(&cfg.out_dir).map_err(|e| Error::io(&cfg.out_dir, e))?;
    let run_json = serde_json::json!({ "model": model_cfg, "train": cfg, "dataset": ds.name, "device": device, "peak_flops": peak_flops });
    checkpoint::write_atomic(
        &cfg.out_dir.join("run.json"),
        serde_json::to_string_pretty(&run_json)
            .expect("json")
            .as_bytes(),
    )?;
    let mut log = JsonlWriter::create(&cfg.out_dir.join("metrics.jsonl"))?;

    let pb = if cfg.verbose {
        metrics::progress_bar(steps as u64, "train")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let note = |msg: &str| {
        if cfg.verbose {
            metrics::say(&pb, msg)
        }
    };
    note(&format!(
        "{} params | {} x {} tokens x {} accum per step | {steps} steps ({:.2} epochs) | {device}, peak {:.0} GFLOP/s",
        model_cfg.num_params(),
        b,
        t,
        cfg.grad_accum,
        (steps * cfg.grad_accum) as f64 / train_loader.batches_per_epoch() as f64,
        peak_flops / 1e9
    ));
    let flops_per_token = model_cfg.flops_per_token(t);
    let tokens_per_step = b * t * cfg.grad_accum;
    let started = Instant::now();
    let mut first_loss = f32::NAN;
    let mut last = (f32::NAN, f32::NAN);
    for step in 0..steps {
        let micro: Vec<_> = (0..cfg.grad_accum)
            .map(|_| train_loader.next_batch())
            .collect();
        let lr = sched.at(step);
        let t0 = Instant::now();
        let stats = strategy.step(
            &micro,
            StepConfig {
                lr,
                grad_clip: cfg.grad_clip,
            },
        )?;
        let secs = t0.elapsed().as_secs_f64();
        if !stats.loss.is_finite() {
            return Err(Error::Input(format!(
                "loss became {} at step {step}: lower the learning rate",
                stats.loss
            )));
        }
        if step == 0 {
            first_loss = stats.loss;
        }
        let is_last = step + 1 == steps;
        let val_loss = if is_last || (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) {
            let v = evaluate(&mut strategy, &mut val_loader, cfg.eval_batches)?;
            note(&format!(
                "step {:>5}: train loss {:.4}, val loss {v:.4}",
                step + 1,
                stats.loss
            ));
            Some(v)
        } else {
            None
        };
        if !is_last && cfg.sample_every > 0 && (step + 1) % cfg.sample_every == 0 {
            let s = sample_text(
                &mut strategy.model,
                ds,
                cfg.sample_tokens.min(200),
                cfg.seed + step as u64,
            )?;
            note(&format!("--- sample at step {} ---\n{s}\n---", step + 1));
        }
        let tokens_per_s = tokens_per_step as f64 / secs;
        let record = StepRecord {
            step: step + 1,
            epoch: train_loader.position.epoch as f64
                + train_loader.position.batch as f64 / train_loader.batches_per_epoch() as f64,
            loss: stats.loss,
            val_loss,
            grad_norm: stats.grad_norm,
            lr,
            ms: secs * 1e3,
            tokens_per_s,
            mfu: metrics::mfu(flops_per_token, tokens_per_s, peak_flops),
            memory: strategy.memory(),
        };
        log.write(&record)?;
        last = (stats.loss, val_loss.unwrap_or(last.1));
        pb.set_message(format!(
            "loss {:.4} | {:.0} tok/s",
            stats.loss, tokens_per_s
        ));
        pb.inc(1);
    }
    pb.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    checkpoint::save_model(&strategy.model, ds.tokenizer.spec(), &cfg.out_dir)?;
    let sample = sample_text(&mut strategy.model, ds, cfg.sample_tokens, cfg.seed)?;
    let tokens_per_s = (steps * tokens_per_step) as f64 / seconds;
    Ok(TrainSummary {
        steps,
        first_loss,
        final_loss: last.0,
        val_loss: last.1,
        tokens_per_s,
        mfu: metrics::mfu(flops_per_token, tokens_per_s, peak_flops),
        seconds,
        memory: strategy.memory(),
        sample,
        out_dir: cfg.out_dir.clone(),
    })
}
