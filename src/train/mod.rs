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
pub mod classify;
pub mod lm;
pub mod mlm;
mod rank;
pub mod resume;
pub mod run_dir;
pub mod schedule;
pub mod spec;
pub mod task;

use crate::backend::{Backend, MemoryReport, PeakRow};
use crate::checkpoint::state;
use crate::comm::CommStats;
use crate::data::TokenizerKind;
use crate::error::{Error, Result};
use crate::metrics::StepRecord;
use crate::model::AdamWConfig;
use crate::parallel::{launch, ParallelConfig, Strategy};
pub use rank::train_rank;
pub use resume::Prepared;
pub use run_dir::{default_run_dir, RunRecord};
use serde::{Deserialize, Serialize};
pub use spec::{TaskData, TaskSpec, TASKS};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
pub use task::{Eval, Task, TaskKind, TrainStream};

/// How long to train: `{"steps": N}` or `{"epochs": E}` in run.json
/// (files before that wrote the Rust names, `Steps` and `Epochs`).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Duration {
    #[serde(alias = "Steps")]
    Steps(usize),
    #[serde(alias = "Epochs")]
    Epochs(f64),
}

/// The most optimizer steps a run may ask for.
pub const MAX_STEPS: usize = 1_000_000_000;
/// The most micro-batches a step may accumulate (`--grad-accum`): every
/// one is a task of the step's program, planned before it runs.
pub const MAX_GRAD_ACCUM: usize = 1 << 16;

impl Duration {
    /// Optimizer steps for a split of `batches_per_epoch` micro-batches.
    pub fn steps(self, batches_per_epoch: usize, grad_accum: usize) -> usize {
        match self {
            Duration::Steps(n) => n,
            Duration::Epochs(e) => {
                // the micro-batches asked for, rounded up, where 1.1 x 100
                // is 110.00000000000001 in binary: a run one step long
                let batches = e * batches_per_epoch as f64;
                let near = batches.round();
                let batches = match (batches - near).abs() <= 1e-9 * near.max(1.0) {
                    true => near,
                    false => batches.ceil(),
                };
                (batches as usize).div_ceil(grad_accum)
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
    /// Train on this many training examples only (a classifier's sample
    /// drawn with the seed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_examples: Option<usize>,
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
    /// Also write the step records as TensorBoard event files here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<PathBuf>,
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
            train_examples: None,
            overwrite: false,
            schedule_steps: None,
            link_latest: false,
            tensorboard: None,
            tokenizer: TokenizerKind::Char,
            progress: None,
        }
    }
}

/// `--min-lr` unless given: a tenth of `--lr` as written, the float
/// nearest it (`--lr 1e-3` gives 0.0001; a tenth of the float 1e-3 is
/// 0.000100000005).
pub fn default_min_lr(lr: f32) -> f32 {
    let written: f64 = lr.to_string().parse().expect("a float reads back");
    (written / 10.0) as f32
}

impl TrainConfig {
    /// Refuses numbers that would train wrongly or not at all, naming the flag.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.batch_size == 0 || self.grad_accum == 0 {
            return bad("--batch-size and --grad-accum must be at least 1".into());
        }
        if self.grad_accum > MAX_GRAD_ACCUM {
            return bad(format!(
                "--grad-accum {} is more than {MAX_GRAD_ACCUM} micro-batches a step",
                self.grad_accum
            ));
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
                "--lr {} must be a positive number (0 trains nothing; a negative rate climbs the loss)",
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
        let paths = [
            ("--out", Some(&self.out_dir)),
            ("--data", self.data.as_ref()),
            ("--init-from", self.init_from.as_ref()),
            ("--resume", self.resume.as_ref()),
            ("--tensorboard", self.tensorboard.as_ref()),
        ];
        let odd = paths
            .into_iter()
            .find_map(|(flag, p)| Some((flag, p.filter(|p| p.to_str().is_none())?)));
        if let Some((flag, p)) = odd {
            return bad(format!(
                "{flag} {}: the path is not valid UTF-8, and run.json records paths as text; rename it",
                p.display()
            ));
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
    #[serde(default)]
    pub how: FaultKind,
}

/// How an injected fault fails a rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// The rank returns an error (and MPI_Abort ends the job).
    #[default]
    Error,
    /// The process stops itself (SIGSTOP), as a debugger or `kill -STOP` would.
    Stop,
    /// The rank's main thread sleeps for ever outside any collective.
    Hang,
    /// The rank panics, as a broken invariant would.
    Panic,
}

impl Fault {
    /// Fails this rank as asked: the error to return, or `None` once a
    /// stopped process is continued (SIGCONT); a hang never returns.
    pub fn strike(&self) -> Option<Error> {
        match self.how {
            FaultKind::Error => Some(Error::Fault {
                rank: self.rank,
                step: self.step,
            }),
            FaultKind::Stop => {
                let _ = signal_hook::low_level::raise(signal_hook::consts::SIGSTOP);
                None
            }
            FaultKind::Hang => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            FaultKind::Panic => {
                panic!("injected panic on rank {} at step {}", self.rank, self.step)
            }
        }
    }
}

#[derive(Clone, Debug, Serialize)]
#[cfg_attr(test, derive(Default))]
pub struct TrainSummary {
    pub steps: usize,
    /// The process's peak RSS when the last step was done, before the
    /// model files and the final checkpoint (rank 0's; Linux only).
    pub peak_rss_at_last_step: Option<u64>,
    pub first_loss: f32,
    pub final_loss: f32,
    /// The last validation loss (NaN if none).
    pub val_loss: f32,
    /// The last validation figures.
    pub val: Option<Eval>,
    /// The test split's figures at the end (a task with one).
    pub test: Option<Eval>,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub seconds: f64,
    /// Rank 0's memory counters.
    pub memory: MemoryReport,
    /// Peak bytes of every rank.
    pub rank_peak_bytes: Vec<PeakRow>,
    /// Under offload, every rank's peak host bytes.
    pub rank_host_peak_bytes: Vec<PeakRow>,
    /// Rank 0's communication, by kind.
    pub comm: CommStats,
    /// Rank 0's communication inside this invocation's training steps
    /// (`comm` less evaluations, samples and the model's gather).
    pub step_comm: CommStats,
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
    /// Every rank's forwards and backwards in the last step of a pipeline
    /// (empty without one).
    pub timelines: Vec<Vec<crate::parallel::Span>>,
}

/// Trains `task` on `par.world_size` thread ranks; returns rank 0's summary.
pub fn train<B: Backend + 'static>(
    make_backend: impl Fn() -> B + Sync,
    task: &dyn Task<B>,
    cfg: &TrainConfig,
    par: ParallelConfig,
    threads: usize,
    timeout: std::time::Duration,
) -> Result<TrainSummary> {
    let mut out = launch::run_local(par.world_size, threads, timeout, |comm| {
        train_rank(make_backend(), task, cfg, par, comm.as_ref())
    })?;
    Ok(out.swap_remove(0).expect("rank 0 returns the summary"))
}

/// A task's model with weights `params` evaluated on one rank with
/// `threads` threads: its test split when `test` and it has one, else its
/// validation split (`cfg` gives the batch shape, `eval_batches` and seed).
pub fn evaluate_params<B: Backend + 'static>(
    backend: B,
    task: &dyn Task<B>,
    params: &[f32],
    cfg: &TrainConfig,
    threads: usize,
    test: bool,
) -> Result<Eval> {
    task.check_eval(cfg)?;
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let single = ParallelConfig::single();
    let model = task.model();
    let mut out = launch::run_local(1, threads, std::time::Duration::from_secs(600), |world| {
        let be = crate::comm::backend_for(&backend, world.as_ref())?;
        let mut s =
            crate::parallel::build(be, model.clone(), single, world.as_ref(), cfg.adamw, b, t)?;
        s.load_full(params)?;
        match test {
            true => task
                .test(s.as_mut(), cfg)?
                .ok_or_else(|| Error::Input("the task has no test split".into())),
            false => task.evaluate(s.as_mut(), cfg),
        }
    })?;
    Ok(out.swap_remove(0))
}

/// Trains a causal language model of any family (the `lm` task) on
/// `par.world_size` thread ranks; returns rank 0's summary.
pub fn train_lm<B: Backend + 'static>(
    make_backend: impl Fn() -> B + Sync,
    model: impl Into<crate::model::ModelConfig>,
    data: &crate::data::Dataset,
    cfg: &TrainConfig,
    par: ParallelConfig,
    threads: usize,
    timeout: std::time::Duration,
) -> Result<TrainSummary> {
    let task = lm::LmTask {
        model: model.into(),
        data,
    };
    train(make_backend, &task, cfg, par, threads, timeout)
}

/// The error for a run whose numbers stopped being finite at step `step`
/// (0-based): its loss or gradient (`updated` false: the update was
/// skipped, and the weights it started from gave those numbers) or, after
/// its update, its evaluation or weights (`updated`). Names the newest
/// checkpoint of an earlier state to resume from: the one this step
/// started from would fail the same way.
fn diverged(step: usize, why: &str, cfg: &TrainConfig, updated: bool) -> Error {
    let bad = step + usize::from(updated);
    let kept: Vec<usize> = (state::list(&cfg.out_dir).unwrap_or_default().iter())
        .filter_map(|d| state::step_of(d))
        .collect();
    let replays = match kept.contains(&bad) {
        true => format!("The checkpoint of step {bad} holds the weights that gave these numbers (resumed, it fails again). "),
        false => String::new(),
    };
    let next = match kept.into_iter().filter(|&n| n < bad).max() {
        Some(n) => format!(
            "The checkpoint of step {n} holds finite weights: resume with `--resume {} --from-step {n} --lr <lower>`",
            cfg.out_dir.display()
        ),
        None => "No checkpoint of an earlier step is kept: start again with a lower --lr (and --checkpoint-every N)".into(),
    };
    Error::Diverged(format!("step {}: {why}. {replays}{next}", step + 1))
}

/// Puts the state to start from into `strategy` and `stream` (local, no
/// collectives): a checkpoint (its model and data must be this run's), or
/// the task's initial weights. Returns the first step.
fn restore<B: Backend>(
    strategy: &mut dyn Strategy,
    stream: &mut dyn TrainStream,
    task: &dyn Task<B>,
    cfg: &TrainConfig,
    backend: &B,
) -> Result<usize> {
    let Some(dir) = &cfg.resume else {
        strategy.load_full(&task.initial_params(cfg, backend)?)?;
        return Ok(0);
    };
    let ckpt = state::load(dir)?;
    let bad = |reason: String| Error::checkpoint(dir, reason);
    let model = task.model();
    if ckpt.index.model != model {
        return Err(bad(format!(
            "holds a model of {}, not the {model} being trained",
            ckpt.index.model
        )));
    }
    // each refusal names what differs: tokenizers alike can hash their
    // data alike, and data alike can be cut by other tokenizers
    if ckpt.index.tokenizer != task.tokenizer() {
        let [then, now] = crate::data::describe_apart(&ckpt.index.tokenizer, &task.tokenizer());
        return Err(bad(format!(
            "was trained on other data than {}: tokenized with {then}, where this run's is \
             tokenized with {now}; resume with the run's own data and tokenizer, or start a new \
             run with --init-from",
            task.data_name(),
        )));
    }
    if !task.trained_on(&ckpt.index.data) {
        return Err(bad(format!(
            "was trained on other data than {} (fingerprint {} vs {}): resume with the run's own data, or start a new run with --init-from",
            task.data_name(),
            ckpt.index.data,
            task.fingerprint()
        )));
    }
    strategy.load_state(&ckpt.params, &ckpt.m, &ckpt.v, ckpt.index.adam_step)?;
    stream.seek(ckpt.index.loader);
    if let Some(m) = ckpt.index.cpu_matmul {
        crate::backend::cpu::blas::force_choice(m);
    }
    Ok(ckpt.index.step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_min_lr_is_a_tenth_of_the_rate_as_written() {
        for (lr, min) in [
            (1e-3, "0.0001"),
            (6e-4, "0.00006"),
            (3e-4, "0.00003"),
            (1.0, "0.1"),
        ] {
            assert_eq!(default_min_lr(lr).to_string(), min);
        }
    }

    /// `--epochs e` is e x the batches an epoch, rounded up, in steps of
    /// --grad-accum (by hand: 1.1 x 100 = 110; 0.07 x 100 = 7; 2.2 x 100 =
    /// 220 in steps of 2; a third of 100 = 33.3, 34 batches: 17 steps of
    /// 2, 34 of 1).
    #[test]
    fn epochs_are_the_batches_they_name_rounded_up_in_steps() {
        for (e, bpe, accum, steps) in [
            (1.1, 100, 1, 110),
            (0.07, 100, 1, 7),
            (0.07, 100_000, 1, 7_000),
            (2.2, 100, 2, 110),
            (1.0 / 3.0, 100, 2, 17),
            (1.0 / 3.0, 100, 1, 34),
            (3.0, 3, 2, 5),
        ] {
            assert_eq!(
                Duration::Epochs(e).steps(bpe, accum),
                steps,
                "{e} x {bpe} / {accum}"
            );
        }
    }
}
