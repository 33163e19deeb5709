//! The training loop on every rank: data -> strategy step -> metrics,
//! evaluation, samples, training-state checkpoints (and resume from them),
//! and the weights written to the run directory at the end.

pub mod bench;
pub mod schedule;

use crate::backend::{Backend, MemoryReport};
use crate::checkpoint;
use crate::checkpoint::state;
use crate::comm::{Comm, CommStats};
use crate::data::{DataLoader, Dataset, LoaderPosition, TokenizerKind};
use crate::error::{Error, Result};
use crate::infer::generate::{generate, SampleConfig};
use crate::metrics::{self, JsonlWriter, StepRecord};
use crate::model::gpt2::init_full;
use crate::model::{AdamWConfig, Gpt2, GptConfig, ParamLayout};
use crate::parallel::{self, launch, ParallelConfig, StepConfig, Strategy};
use schedule::LrSchedule;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// How long to train.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub enum Duration {
    Steps(usize),
    Epochs(f64),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
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
    /// Progress bar and messages on stderr (rank 0 only).
    pub verbose: bool,
    /// Testing aid: this rank fails at the start of this step (0-based).
    pub fault: Option<Fault>,
    /// Write a training-state checkpoint every N steps (0: only at the end
    /// and when stopped); the newest `keep_checkpoints` are kept.
    pub checkpoint_every: usize,
    pub keep_checkpoints: usize,
    /// A checkpoint directory to continue from (any strategy or world size).
    pub resume: Option<PathBuf>,
    /// Stop after this many steps of this run (checkpointing first), as Ctrl-C does.
    pub stop_after: Option<usize>,
    /// Start from these weights (a distgpt model directory or a Hugging Face folder) instead of a fresh init.
    pub init_from: Option<PathBuf>,
    /// Where the data came from, recorded so `--resume` can reload it.
    pub data: Option<PathBuf>,
    pub tokenizer: TokenizerKind,
    /// A bar to drive instead of drawing one (`compare`'s per-run bar); its
    /// length is set to the run's steps. Messages are printed only when verbose.
    #[serde(skip)]
    pub progress: Option<indicatif::ProgressBar>,
}

impl Default for TrainConfig {
    /// A short single-run configuration; every field is meant to be set.
    fn default() -> Self {
        TrainConfig {
            batch_size: 8,
            seq_len: 64,
            grad_accum: 1,
            duration: Duration::Steps(10),
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 0,
            adamw: AdamWConfig::default(),
            grad_clip: 1.0,
            eval_every: 0,
            eval_batches: 1,
            sample_every: 0,
            sample_tokens: 1,
            seed: 0,
            out_dir: PathBuf::from("runs/default"),
            peak_flops: None,
            verbose: false,
            fault: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            resume: None,
            stop_after: None,
            init_from: None,
            data: None,
            tokenizer: TokenizerKind::Char,
            progress: None,
        }
    }
}

/// Set by a Ctrl-C handler: finish the step, checkpoint, stop.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// An injected failure, to show that the other ranks stop and name it.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Fault {
    pub rank: usize,
    pub step: usize,
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
    /// Rank 0's memory counters.
    pub memory: MemoryReport,
    /// Peak bytes of every rank: [params, grads, optimizer, activations, other, total].
    pub rank_peak_bytes: Vec<[u64; 6]>,
    /// Rank 0's communication, by kind.
    pub comm: CommStats,
    /// Bytes sent and seconds spent in collectives, per rank.
    pub rank_comm_bytes: Vec<u64>,
    pub rank_comm_seconds: Vec<f64>,
    /// Loss of every step (for equivalence checks).
    pub losses: Vec<f32>,
    /// Rank 0's record of every step of this run, as written to metrics.jsonl.
    pub history: Vec<StepRecord>,
    /// The trained parameters, whole-model layout.
    pub params: Vec<f32>,
    pub sample: String,
    pub out_dir: PathBuf,
}

/// Mean validation loss over the first `n` batches of the val split.
fn evaluate(strategy: &mut dyn Strategy, val: &mut DataLoader, n: usize) -> Result<f32> {
    val.seek(LoaderPosition::default());
    let n = n.clamp(1, val.batches_per_epoch());
    let mut sum = 0.0f64;
    for _ in 0..n {
        sum += strategy.eval_loss(&val.next_batch())? as f64;
    }
    Ok((sum / n as f64) as f32)
}

/// A sample from whole-model parameters.
fn sample_text<B: Backend>(
    backend: B,
    cfg: &GptConfig,
    params: &[f32],
    ds: &Dataset,
    tokens: usize,
    seed: u64,
) -> Result<String> {
    let mut model = Gpt2::new(backend, cfg.clone())?;
    model.params.copy_from_slice(params);
    let tk = &ds.tokenizer;
    let prompt = match tk.eot() {
        Some(eot) => vec![eot],
        None => tk.encode("\n").unwrap_or_else(|_| vec![0]),
    };
    let sc = SampleConfig {
        max_new_tokens: tokens,
        temperature: 0.8,
        top_k: 40,
        top_p: 1.0,
        seed,
    };
    let out = generate(&model, &[prompt], &sc, tk.eot(), |_, _| {})?;
    Ok(tk.decode(&out[0]))
}

/// Rank 0's `path`, on every rank.
fn agree_on_path(world: &dyn Comm, path: &std::path::Path) -> Result<PathBuf> {
    if world.size() == 1 {
        return Ok(path.to_path_buf());
    }
    let text = path.to_string_lossy();
    let mut len = [text.len() as f32];
    world.broadcast(&mut len, 0)?;
    let mut bytes: Vec<f32> = if world.rank() == 0 {
        text.bytes().map(f32::from).collect()
    } else {
        vec![0.0; len[0] as usize]
    };
    world.broadcast(&mut bytes, 0)?;
    Ok(PathBuf::from(
        String::from_utf8_lossy(&bytes.iter().map(|&b| b as u8).collect::<Vec<u8>>()).into_owned(),
    ))
}

/// Trains on `par.world_size` thread ranks; returns rank 0's summary.
pub fn train<B: Backend + 'static>(
    make_backend: impl Fn() -> B + Sync,
    model_cfg: GptConfig,
    ds: &Dataset,
    cfg: &TrainConfig,
    par: ParallelConfig,
    threads: usize,
    timeout: std::time::Duration,
) -> Result<TrainSummary> {
    let mut out = launch::run_local(par.world_size, threads, timeout, |comm| {
        train_rank(
            make_backend(),
            model_cfg.clone(),
            ds,
            cfg,
            par,
            comm.as_ref(),
        )
    })?;
    Ok(out.swap_remove(0).expect("rank 0 returns the summary"))
}

/// One rank's training loop over `world`; rank 0 logs, saves and returns the summary.
pub fn train_rank<B: Backend + 'static>(
    backend: B,
    model_cfg: GptConfig,
    ds: &Dataset,
    cfg: &TrainConfig,
    par: ParallelConfig,
    world: &dyn Comm,
) -> Result<Option<TrainSummary>> {
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
    let lead = world.rank() == 0;
    // Ranks may have chosen different run directories (a default named by
    // the clock, a temporary directory per process): rank 0's wins.
    let cfg = &TrainConfig {
        out_dir: agree_on_path(world, &cfg.out_dir)?,
        ..cfg.clone()
    };
    let verbose = cfg.verbose && lead;
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
    let device = backend.name();
    let sample_backend = backend.clone_fresh();
    let mut strategy = parallel::build(backend, model_cfg.clone(), par, world, cfg.adamw, b, t)?;
    // Every strategy starts from the same whole-model initialisation.
    let peak_flops = match cfg.peak_flops {
        Some(p) => p,
        None => {
            let mut p = [if lead {
                sample_backend.measure_peak_flops() as f32
            } else {
                0.0
            }];
            world.broadcast(&mut p, 0)?;
            p[0] as f64
        }
    };
    let start = match &cfg.resume {
        Some(dir) => {
            let ckpt = state::load(dir)?;
            if ckpt.index.params_total != ParamLayout::new(&model_cfg).total() {
                return Err(Error::Checkpoint {
                    path: dir.clone(),
                    reason: format!(
                        "holds {} parameters, the model has {}",
                        ckpt.index.params_total,
                        ParamLayout::new(&model_cfg).total()
                    ),
                });
            }
            strategy.load_state(&ckpt.params, &ckpt.m, &ckpt.v, ckpt.index.adam_step);
            train_loader.seek(ckpt.index.loader);
            ckpt.index.step
        }
        None => {
            match &cfg.init_from {
                Some(dir) => {
                    let (m, _) = checkpoint::load_model(sample_backend.clone_fresh(), dir)?;
                    if m.config != model_cfg {
                        return Err(Error::Config(format!(
                            "{} holds a {:?}, not the {:?} being trained",
                            dir.display(),
                            m.config,
                            model_cfg
                        )));
                    }
                    strategy.load_full(&m.params);
                }
                None => strategy.load_full(&init_full(&model_cfg, cfg.seed)),
            }
            0
        }
    };
    if start >= steps {
        return Err(Error::Input(format!(
            "the checkpoint is at step {start}; this run has {steps} steps: nothing left to train"
        )));
    }

    let mut log = None;
    if lead {
        std::fs::create_dir_all(&cfg.out_dir).map_err(|e| Error::io(&cfg.out_dir, e))?;
        let run_path = cfg.out_dir.join("run.json");
        // A resumed run keeps the record of the run it continues.
        if start == 0 || !run_path.exists() {
            let run_json = serde_json::json!({ "model": model_cfg, "train": cfg, "parallel": par, "dataset": ds.name, "device": device, "peak_flops": peak_flops });
            checkpoint::write_atomic(
                &run_path,
                serde_json::to_string_pretty(&run_json)
                    .expect("json")
                    .as_bytes(),
            )?;
        }
        let metrics_path = cfg.out_dir.join("metrics.jsonl");
        log = Some(if start > 0 {
            JsonlWriter::append(&metrics_path)?
        } else {
            JsonlWriter::create(&metrics_path)?
        });
    }
    let pb = match (&cfg.progress, lead) {
        (Some(bar), true) => {
            bar.set_length(steps as u64);
            bar.set_position(start as u64);
            bar.clone()
        }
        _ if verbose => metrics::progress_bar(steps as u64, "train"),
        _ => indicatif::ProgressBar::hidden(),
    };
    let note = |msg: &str| {
        if verbose {
            metrics::say(&pb, msg)
        }
    };
    note(&format!(
        "training {} layers x {} heads x {} wide (block {}) on {} ({} train / {} val tokens)",
        model_cfg.n_layer,
        model_cfg.n_head,
        model_cfg.n_embd,
        model_cfg.block_size,
        ds.name,
        ds.train.len(),
        ds.val.len()
    ));
    note(&format!(
        "{} params | {} x {} tokens x {} accum per step | {steps} steps ({:.2} epochs) | {:?} on {} rank(s), tp {} | {device}, peak {:.0} GFLOP/s per rank",
        model_cfg.num_params(),
        b,
        t,
        cfg.grad_accum,
        (steps * cfg.grad_accum) as f64 / train_loader.batches_per_epoch() as f64,
        par.strategy,
        par.world_size,
        par.resolved().tp,
        peak_flops / 1e9
    ));
    let flops_per_token = model_cfg.flops_per_token(t);
    let tokens_per_step = b * t * cfg.grad_accum;
    let total_peak = peak_flops * par.world_size as f64;
    let started = Instant::now();
    let mut losses = Vec::with_capacity(steps);
    let mut history = Vec::new();
    let mut val_last = f32::NAN;
    let mut rank_peaks = vec![0.0f32; 6 * world.size()];
    for step in start..steps {
        if cfg
            .fault
            .is_some_and(|f| f.rank == world.rank() && f.step == step)
        {
            return Err(Error::Fault {
                rank: world.rank(),
                step,
            });
        }
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
        losses.push(stats.loss);
        let mut stop = [0.0f32];
        if lead
            && (INTERRUPTED.load(Ordering::SeqCst)
                || cfg.stop_after.is_some_and(|n| step + 1 - start >= n))
        {
            stop[0] = 1.0;
        }
        world.broadcast(&mut stop, 0)?;
        let stopping = stop[0] != 0.0 && step + 1 < steps;
        let is_last = step + 1 == steps || stopping;
        let val_loss = if is_last || (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) {
            let v = evaluate(strategy.as_mut(), &mut val_loader, cfg.eval_batches)?;
            note(&format!(
                "step {:>5}: train loss {:.4}, val loss {v:.4}",
                step + 1,
                stats.loss
            ));
            val_last = v;
            Some(v)
        } else {
            None
        };
        if !is_last && cfg.sample_every > 0 && (step + 1) % cfg.sample_every == 0 {
            let full = strategy.full_params()?;
            if lead {
                let s = sample_text(
                    sample_backend.clone_fresh(),
                    &model_cfg,
                    &full,
                    ds,
                    cfg.sample_tokens.min(200),
                    cfg.seed + step as u64,
                )?;
                note(&format!("--- sample at step {} ---\n{s}\n---", step + 1));
            }
        }
        world.all_gather(
            &strategy.memory().peak_row().map(|x| x as f32),
            &mut rank_peaks,
        )?;
        let tokens_per_s = tokens_per_step as f64 / secs;
        if let Some(log) = log.as_mut() {
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
                mfu: metrics::mfu(flops_per_token, tokens_per_s, total_peak),
                memory: strategy.memory(),
                rank_peak_bytes: rank_peaks
                    .chunks(6)
                    .map(|c| c.iter().map(|&x| x as u64).collect())
                    .collect(),
                comm: strategy.comm_stats(),
            };
            log.write(&record)?;
            history.push(record);
        }
        pb.set_message(format!(
            "loss {:.4} | {:.0} tok/s",
            stats.loss, tokens_per_s
        ));
        pb.inc(1);
        if is_last || (cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0) {
            let info = state::SaveInfo {
                step: step + 1,
                adam_step: (step + 1) as u32,
                loader: train_loader.position,
                strategy: &format!("{:?}", par.strategy).to_lowercase(),
                tp: par.resolved().tp,
                params_total: ParamLayout::new(&model_cfg).total(),
                model: &model_cfg,
                keep: cfg.keep_checkpoints,
            };
            state::save(&cfg.out_dir, &info, &strategy.owned_state(), world)?;
            if stopping {
                note(&format!(
                    "stopped after step {}; resume with --resume {}",
                    step + 1,
                    cfg.out_dir.display()
                ));
            }
        }
        if stopping {
            break;
        }
    }
    pb.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let memory = strategy.memory();
    let comm = strategy.comm_stats();
    let mut comm_all = vec![0.0f32; 2 * world.size()];
    world.all_gather(
        &[comm.total_bytes() as f32, comm.seconds as f32],
        &mut comm_all,
    )?;
    let params = strategy.full_params()?;
    drop(strategy);
    if !lead {
        return Ok(None);
    }
    let mut model = Gpt2::new(sample_backend.clone_fresh(), model_cfg.clone())?;
    model.params.copy_from_slice(&params);
    checkpoint::save_model(&model, ds.tokenizer.spec(), &cfg.out_dir)?;
    drop(model);
    let sample = sample_text(
        sample_backend,
        &model_cfg,
        &params,
        ds,
        cfg.sample_tokens,
        cfg.seed,
    )?;
    let tokens_per_s = (losses.len() * tokens_per_step) as f64 / seconds;
    Ok(Some(TrainSummary {
        steps: start + losses.len(),
        first_loss: losses[0],
        final_loss: *losses.last().expect("at least one step"),
        val_loss: val_last,
        tokens_per_s,
        mfu: metrics::mfu(flops_per_token, tokens_per_s, total_peak),
        seconds,
        memory,
        rank_peak_bytes: rank_peaks
            .chunks(6)
            .map(|c| std::array::from_fn(|i| c[i] as u64))
            .collect(),
        comm,
        rank_comm_bytes: comm_all.chunks(2).map(|c| c[0] as u64).collect(),
        rank_comm_seconds: comm_all.chunks(2).map(|c| c[1] as f64).collect(),
        losses,
        history,
        params,
        sample,
        out_dir: cfg.out_dir.clone(),
    }))
}
