//! The training loop on every rank: data -> strategy step -> metrics,
//! evaluation, samples, training-state checkpoints (and resume from them),
//! and the weights written to the run directory at the end.
//!
//! What a run guarantees: a new run never writes into another run's
//! directory; a stop (signal or `stop_after`) finishes the step and writes a
//! checkpoint on every rank; a non-finite loss or gradient stops before the
//! update, so no checkpoint ever holds one; the model files of a finished
//! run are written before its final checkpoint.

pub mod bench;
pub mod run_dir;
pub mod schedule;

use crate::backend::{Backend, MemoryReport};
use crate::checkpoint;
use crate::checkpoint::state;
use crate::comm::{Comm, CommStats};
use crate::data::{DataLoader, Dataset, LoaderPosition, TokenizerKind};
use crate::error::{Error, Result};
use crate::infer::generate::{generate, SampleConfig};
use crate::metrics::{self, StepRecord};
use crate::model::gpt2::init_full;
use crate::model::{AdamWConfig, Gpt2, GptConfig, ParamLayout};
use crate::parallel::{self, launch, ParallelConfig, StepConfig, Strategy};
pub use run_dir::{default_run_dir, RunRecord};
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

/// The most optimizer steps a run may ask for.
pub const MAX_STEPS: usize = 1_000_000_000;

impl Duration {
    /// Optimizer steps for a split of `batches_per_epoch` micro-batches.
    pub fn steps(self, batches_per_epoch: usize, grad_accum: usize) -> usize {
        match self {
            Duration::Steps(n) => n,
            Duration::Epochs(e) => {
                ((e * batches_per_epoch as f64) / grad_accum as f64).ceil() as usize
            }
        }
    }
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
    /// A log line every N steps when no progress bar is drawn (output not a
    /// terminal); 0: none.
    #[serde(default)]
    pub log_every: usize,
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
    /// Empty a directory that holds another run before starting a new one there.
    #[serde(default)]
    pub overwrite: bool,
    /// Steps the learning-rate schedule spans (default: the run's steps);
    /// a run extended past it continues at `min_lr`.
    #[serde(default)]
    pub schedule_steps: Option<usize>,
    /// Point `latest` beside the run directory at it (default-named runs).
    #[serde(skip)]
    pub link_latest: bool,
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
            log_every: 0,
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
            overwrite: false,
            schedule_steps: None,
            link_latest: false,
            tokenizer: TokenizerKind::Char,
            progress: None,
        }
    }
}

impl TrainConfig {
    /// Refuses numbers that would train wrongly or not at all, naming the flag.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.batch_size == 0 || self.grad_accum == 0 {
            return bad("--batch-size and --grad-accum must be at least 1".into());
        }
        match self.duration {
            Duration::Steps(n) if n == 0 || n > MAX_STEPS => {
                return bad(format!("--steps {n} must be between 1 and {MAX_STEPS}"))
            }
            Duration::Epochs(e) if !(e > 0.0 && e <= 1e6) => {
                return bad(format!(
                    "--epochs {e} must be a positive number of passes (at most 1e6)"
                ))
            }
            _ => {}
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "--lr {} must be a positive number (a negative rate climbs the loss)",
                self.lr
            ));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad(format!(
                "--min-lr {} must be between 0 and --lr {}",
                self.min_lr, self.lr
            ));
        }
        if self.warmup_steps > MAX_STEPS {
            return bad(format!(
                "--warmup {} is more than {MAX_STEPS} steps",
                self.warmup_steps
            ));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad(format!(
                "--grad-clip {} must be a number >= 0 (0 turns clipping off)",
                self.grad_clip
            ));
        }
        let a = &self.adamw;
        for (name, beta) in [("--beta1", a.beta1), ("--beta2", a.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(format!("{name} {beta} must be in [0, 1)"));
            }
        }
        if !(a.eps.is_finite() && a.eps > 0.0) {
            return bad(format!("AdamW epsilon {} must be positive", a.eps));
        }
        if !(a.weight_decay.is_finite() && a.weight_decay >= 0.0) {
            return bad(format!(
                "--weight-decay {} must be a number >= 0",
                a.weight_decay
            ));
        }
        if self.keep_checkpoints == 0 {
            return bad("--keep-checkpoints must be at least 1".into());
        }
        Ok(())
    }
}

/// Set by a signal handler (Ctrl-C, SIGTERM): finish the step, checkpoint, stop.
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
    /// Stopped before its last step (a signal or `stop_after`), with a checkpoint.
    pub stopped: bool,
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
    model.set_params(params)?;
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
    let mut len = [text.len() as u64];
    world.broadcast(&mut len, 0)?;
    let mut bytes = if world.rank() == 0 {
        text.as_bytes().to_vec()
    } else {
        vec![0u8; len[0] as usize]
    };
    world.broadcast(&mut bytes, 0)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| Error::Comm(format!("rank 0's path arrived as invalid UTF-8: {e}")))?;
    Ok(PathBuf::from(text))
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

/// The error for a step whose loss or gradient was not finite: the update
/// was skipped, so the newest checkpoint is the last good state.
fn diverged(step: usize, why: &str, cfg: &TrainConfig) -> Error {
    let newest = state::list(&cfg.out_dir)
        .ok()
        .and_then(|l| l.last().and_then(|d| state::step_of(d)));
    Error::Diverged(format!(
        "step {}: {why}. {}",
        step + 1,
        match newest {
            Some(n) => format!(
                "The newest checkpoint (step {n}) holds finite weights: resume with `--resume {} --from-step {n} --lr <lower>`",
                cfg.out_dir.display()
            ),
            None => "No checkpoint was written yet: start again with a lower --lr (and --checkpoint-every N)".into(),
        }
    ))
}

/// Puts the state to start from into `strategy` and `loader` (local, no
/// collectives): a checkpoint (its model and data must be this run's), the
/// weights of `init_from`, or a fresh initialisation. Returns the first step.
fn restore<B: Backend>(
    strategy: &mut dyn Strategy,
    loader: &mut DataLoader,
    model_cfg: &GptConfig,
    ds: &Dataset,
    cfg: &TrainConfig,
    fingerprint: &str,
    backend: &B,
) -> Result<usize> {
    Ok(match &cfg.resume {
        Some(dir) => {
            let ckpt = state::load(dir)?;
            let bad = |reason: String| Error::Checkpoint {
                path: dir.clone(),
                reason,
            };
            if &ckpt.index.model != model_cfg {
                return Err(bad(format!(
                    "holds a model of {}, not the {} being trained",
                    ckpt.index.model, model_cfg
                )));
            }
            if ckpt.index.tokenizer != ds.tokenizer.spec() || ckpt.index.data != fingerprint {
                return Err(bad(format!(
                    "was trained on other data than {} (fingerprint {} vs {fingerprint}): resume with the run's own data, or start a new run with --init-from",
                    ds.name, ckpt.index.data
                )));
            }
            strategy.load_state(&ckpt.params, &ckpt.m, &ckpt.v, ckpt.index.adam_step)?;
            loader.seek(ckpt.index.loader);
            ckpt.index.step
        }
        None => {
            match &cfg.init_from {
                Some(dir) => {
                    let (m, _) = checkpoint::load_model(backend.clone_fresh(), dir)?;
                    if &m.config != model_cfg {
                        return Err(Error::Config(format!(
                            "{} holds a model of {}, not the {} being trained",
                            dir.display(),
                            m.config,
                            model_cfg
                        )));
                    }
                    strategy.load_full(&m.params_host()?)?;
                }
                None => strategy.load_full(&init_full(model_cfg, cfg.seed))?,
            }
            0
        }
    })
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
    cfg.validate()?;
    let (b, t) = (cfg.batch_size, cfg.seq_len);
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
    let steps = cfg
        .duration
        .steps(train_loader.batches_per_epoch(), cfg.grad_accum)
        .clamp(1, MAX_STEPS);
    let horizon = cfg.schedule_steps.unwrap_or(steps);
    let sched = LrSchedule {
        max_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: horizon,
    };
    let device = backend.name();
    let sample_backend = backend.clone_fresh();
    let mut strategy = parallel::build(backend, model_cfg.clone(), par, world, cfg.adamw, b, t)?;
    // Every strategy starts from the same whole-model initialisation.
    let (peak_flops, peak_source) = match cfg.peak_flops {
        Some(p) => (p, "--peak-tflops".to_string()),
        None => {
            // Rank 0's number (from the cache, or measured and cached), for every rank.
            let peak = lead.then(|| crate::metrics::peak::of(&sample_backend, false));
            let mut p = [peak.as_ref().map_or(0.0, |p| p.flops)];
            world.broadcast(&mut p, 0)?;
            (p[0], peak.map(|p| p.source).unwrap_or_default())
        }
    };
    let data_fingerprint = ds.fingerprint();
    let start = restore(
        strategy.as_mut(),
        &mut train_loader,
        &model_cfg,
        ds,
        cfg,
        data_fingerprint,
        &sample_backend,
    )?;
    if start >= steps {
        return Err(Error::Input(format!(
            "the checkpoint is at step {start}; this run has {steps} steps: nothing left to train (extend it with --steps)"
        )));
    }

    // Rank 0 alone: the run directory, run.json and the step logs.
    let mut log = None;
    if lead {
        let record = RunRecord {
            model: model_cfg.clone(),
            train: TrainConfig {
                resume: None,
                stop_after: None,
                fault: None,
                overwrite: false,
                schedule_steps: Some(horizon),
                ..cfg.clone()
            },
            parallel: par,
            dataset: ds.name.clone(),
            device: device.to_string(),
            peak_flops,
            segments: Vec::new(),
        };
        log = Some(run_dir::open(
            &cfg.out_dir,
            record,
            start,
            steps,
            cfg,
            verbose,
        )?);
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
    pb.set_position(start as u64);
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
        "{} params | {} x {} tokens x {} accum per step | {steps} steps ({:.2} epochs) | {} on {} rank(s), tp {} | {device}, peak {:.0} GFLOP/s per rank ({peak_source})",
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
    if horizon < steps && start < steps {
        note(&format!(
            "the learning-rate schedule ends at step {horizon}; later steps run at --min-lr {}",
            cfg.min_lr
        ));
    }
    let flops_per_token = model_cfg.flops_per_token(t);
    let tokens_per_step = b * t * cfg.grad_accum;
    let total_peak = if sample_backend.ranks_share_device() {
        peak_flops
    } else {
        peak_flops * par.world_size as f64
    };
    let started = Instant::now();
    let mut losses = Vec::new();
    let mut history = Vec::new();
    let mut val_last = f32::NAN;
    let mut rank_peaks = vec![0u64; 6 * world.size()];
    let mut stopped = false;
    let mut final_params = None;
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
        let stats = match strategy.step(
            &micro,
            StepConfig {
                lr,
                grad_clip: cfg.grad_clip,
            },
        ) {
            Err(Error::Diverged(why)) => return Err(diverged(step, &why, cfg)),
            other => other?,
        };
        let secs = t0.elapsed().as_secs_f64();
        losses.push(stats.loss);
        // A signal may reach only some ranks (mpirun forwards it to each
        // process): any rank's stop stops all, at the same step.
        let mut stop = [u32::from(
            INTERRUPTED.load(Ordering::SeqCst)
                || cfg.stop_after.is_some_and(|n| step + 1 - start >= n),
        )];
        world.all_reduce(&mut stop)?;
        let stopping = stop[0] != 0 && step + 1 < steps;
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
        world.all_gather(&strategy.memory().peak_row(), &mut rank_peaks)?;
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
                rank_peak_bytes: rank_peaks.chunks(6).map(<[u64]>::to_vec).collect(),
                comm: strategy.comm_stats(),
            };
            log.write(&record)?;
            history.push(record);
        }
        pb.set_message(format!(
            "loss {:.4} | {:.0} tok/s",
            stats.loss, tokens_per_s
        ));
        // Without a terminal the bar is not drawn: a line every log_every steps instead.
        if pb.is_hidden() && cfg.log_every > 0 && (step + 1) % cfg.log_every == 0 {
            let done = step + 1 - start;
            let eta_s = started.elapsed().as_secs_f64() / done as f64 * (steps - step - 1) as f64;
            note(&format!(
                "step {:>5}/{steps}: loss {:.4} | lr {lr:.2e} | grad norm {:.3} | {:.0} tokens/s | ETA {}",
                step + 1,
                stats.loss,
                stats.grad_norm,
                tokens_per_s,
                metrics::human_duration(eta_s)
            ));
        }
        pb.inc(1);
        if is_last {
            // The model files come before the final checkpoint: a run whose
            // final checkpoint exists is always readable.
            let full = strategy.full_params()?;
            if lead {
                let mut model = Gpt2::new(sample_backend.clone_fresh(), model_cfg.clone())?;
                model.set_params(&full)?;
                checkpoint::save_model(&model, ds.tokenizer.spec(), &cfg.out_dir)?;
            }
            final_params = Some(full);
        }
        if is_last || (cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0) {
            let info = state::SaveInfo {
                step: step + 1,
                adam_step: (step + 1) as u32,
                loader: train_loader.position,
                strategy: &par.strategy.to_string(),
                tp: par.resolved().tp,
                params_total: ParamLayout::new(&model_cfg).total(),
                model: &model_cfg,
                tokenizer: &ds.tokenizer.spec(),
                data: data_fingerprint,
                keep: cfg.keep_checkpoints,
            };
            state::save(&cfg.out_dir, &info, &strategy.owned_state()?, world)?;
            if stopping {
                note(&format!(
                    "stopped after step {}; resume with --resume {}",
                    step + 1,
                    cfg.out_dir.display()
                ));
            }
        }
        if stopping {
            stopped = true;
            break;
        }
    }
    pb.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let memory = strategy.memory();
    let comm = strategy.comm_stats();
    let mut rank_comm_bytes = vec![0u64; world.size()];
    world.all_gather(&[comm.total_bytes()], &mut rank_comm_bytes)?;
    let mut rank_comm_seconds = vec![0f64; world.size()];
    world.all_gather(&[comm.seconds], &mut rank_comm_seconds)?;
    drop(strategy);
    let params = final_params.expect("the last step saves the model");
    if !lead {
        return Ok(None);
    }
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
            .map(|c| std::array::from_fn(|i| c[i]))
            .collect(),
        comm,
        rank_comm_bytes,
        rank_comm_seconds,
        losses,
        history,
        params,
        sample,
        out_dir: cfg.out_dir.clone(),
        stopped,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn agree_on_path_carries_a_non_ascii_path_intact() {
        let path = PathBuf::from("/tmp/läufe/модель 模型 🚀/ckpt");
        let out = launch::run_local(3, 3, Duration::from_secs(10), |c| {
            let mine = if c.rank() == 0 {
                path.clone()
            } else {
                PathBuf::from("elsewhere")
            };
            agree_on_path(c.as_ref(), &mine)
        })
        .unwrap();
        assert_eq!(out, vec![path.clone(); 3]);
    }
}
