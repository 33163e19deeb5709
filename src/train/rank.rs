//! The one run driver: one rank's run of any task, in named phases. Each
//! phase says whether it is **collective** (every rank calls it, in the same
//! order, and it talks to the others) or **rank 0's** (only rank 0 does the work, and it never
//! waits on another rank). Keeping collectives out of rank-0-only code is
//! what keeps ranks from waiting on each other forever.

use super::run_dir::{self, RunRecord, StepLogs};
use super::schedule::LrSchedule;
use super::task::{epochs_done, Eval, Task, TrainStream};
use super::{diverged, restore, Duration, TrainConfig, TrainSummary, INTERRUPTED, MAX_STEPS};
use crate::backend::cpu::blas;
use crate::backend::{Backend, MemoryReport, PeakRow};
use crate::checkpoint::state;
use crate::comm::{Comm, CommStats};
use crate::error::{Error, Result};
use crate::metrics::{self, StepRecord};
use crate::model::{ModelConfig, Precision};
use crate::parallel::{self, ParallelConfig, StepConfig, Strategy};
use indicatif::ProgressBar;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// One rank's run of `task` over `world`; rank 0 logs, saves and returns the summary.
pub fn train_rank<B: Backend + 'static>(
    backend: B,
    task: &dyn Task<B>,
    cfg: &TrainConfig,
    par: ParallelConfig,
    world: &dyn Comm,
) -> Result<Option<TrainSummary>> {
    let mut run = Run::set_up(backend, task, cfg, par, world)?;
    run.open_outputs()?;
    for step in run.start..run.steps {
        let done = run.train_step(step)?;
        let val_loss = run.evaluate_if_due(step, &done)?;
        run.sample_if_due(step, &done)?;
        run.record(step, &done, val_loss)?;
        if done.is_last {
            run.peak_rss_at_last_step = metrics::peak_rss_bytes();
            run.strategy.free_activations();
            run.save_model(step)?;
        }
        run.checkpoint_if_due(step, &done)?;
        if done.stopping {
            run.stopped = true;
            break;
        }
    }
    run.finish()
}

/// What one optimizer step did.
struct StepDone {
    loss: f32,
    grad_norm: f32,
    lr: f32,
    seconds: f64,
    /// Tokens the step trained on (a classifier's real tokens).
    tokens: usize,
    /// An epoch ended within the step.
    epoch_ended: bool,
    /// The run's last step: the planned last, or the one a stop ends at.
    is_last: bool,
    /// Some rank was asked to stop before the planned last step.
    stopping: bool,
}

/// A rank's run: its strategy, data, schedule and (on rank 0) its outputs.
struct Run<'a, B: Backend> {
    world: &'a dyn Comm,
    task: &'a dyn Task<B>,
    /// The run's configuration with rank 0's run directory.
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    par: ParallelConfig,
    strategy: Box<dyn Strategy>,
    /// A backend of this rank's kind for samples and the model files.
    spare: B,
    train_loader: Box<dyn TrainStream + 'a>,
    sched: LrSchedule,
    start: usize,
    steps: usize,
    /// The peak FLOP/s of all ranks together: MFU's denominator, and
    /// what run.json records.
    total_peak: f64,
    peak_source: String,
    lead: bool,
    /// Rank 0 with messages on.
    verbose: bool,
    /// Rank 0's metrics.jsonl and metrics.csv (None elsewhere).
    logs: Option<StepLogs>,
    /// Rank 0's progress bar (hidden elsewhere).
    pb: ProgressBar,
    started: Instant,
    /// Tokens trained on by this invocation.
    tokens: usize,
    losses: Vec<f32>,
    /// The collectives inside this invocation's training steps.
    step_comm: CommStats,
    history: Vec<StepRecord>,
    val_last: Option<Eval>,
    /// Every rank's peak memory row, as of the newest step, and under
    /// offload its peak host memory row after it ([`Run::peak_rows`]).
    rank_peaks: Vec<u64>,
    stopped: bool,
    /// Rank 0 could not write a step to `metrics.jsonl`: stop as a signal would.
    record_failed: bool,
    /// The process's peak RSS when the last step was done.
    peak_rss_at_last_step: Option<u64>,
}

/// **Collective.** Refuses a run whose ranks were given other settings
/// than rank 0 (under mpirun each process has its own command line and
/// reads its own data): those [`run_dir::settings`] counts, the layout, the
/// model and the data's fingerprint. A rank of another shape wrote past
/// MPI's buffers; one of another seed or learning rate trained what no
/// record says.
fn agree_on_settings<B: Backend>(
    task: &dyn Task<B>,
    cfg: &TrainConfig,
    par: ParallelConfig,
    world: &dyn Comm,
) -> Result<()> {
    if world.size() == 1 {
        return Ok(());
    }
    let mut settings = run_dir::settings(cfg, &par);
    // the data's fingerprint compares what it holds: a copy on another
    // machine may lie at another path
    settings["data"] = serde_json::Value::Null;
    let mine = serde_json::json!({
        "settings": settings,
        "layout": par,
        "model": task.model(),
        "data": task.fingerprint(),
    });
    let all = world.gather(&mine)?;
    match all
        .iter()
        .enumerate()
        .find_map(|(r, v)| Some((r, difference("", &all[0], v)?)))
    {
        Some((r, what)) => Err(Error::Config(format!(
            "rank {r} was given other settings than rank 0: {what}; every rank of a run takes \
             the same command line and data"
        ))),
        None => Ok(()),
    }
}

/// The first place where `b` differs from `a` (rank 0's), as "PATH is B
/// (rank 0's: A)", an f32 setting as it was written (0.1, not its f64).
fn difference(path: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    let shown = |v: &Value| match v.as_f64() {
        Some(x) if v.is_f64() && f64::from(x as f32) == x => (x as f32).to_string(),
        _ => v.to_string(),
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x.keys().chain(y.keys()).find_map(|k| {
            let at = match path {
                "" => k.clone(),
                _ => format!("{path}.{k}"),
            };
            difference(
                &at,
                x.get(k).unwrap_or(&Value::Null),
                y.get(k).unwrap_or(&Value::Null),
            )
        }),
        _ => (a != b).then(|| format!("{path} is {} (rank 0's: {})", shown(b), shown(a))),
    }
}

impl<'a, B: Backend + 'static> Run<'a, B> {
    /// **Collective.** Agrees on the run directory, builds the strategy (tp
    /// and mesh groups split the world), agrees on the peak FLOP/s, and
    /// loads the state to start from (a checkpoint, `init_from`, or a fresh
    /// initialisation: every strategy starts from the same whole model).
    fn set_up(
        backend: B,
        task: &'a dyn Task<B>,
        cfg: &TrainConfig,
        par: ParallelConfig,
        world: &'a dyn Comm,
    ) -> Result<Self> {
        cfg.validate()?;
        par.pipeline.check_micro_batches(cfg.grad_accum)?;
        let model_cfg = task.model();
        let (b, t) = (cfg.batch_size, cfg.seq_len);
        if t == 0 || t > model_cfg.block_size() {
            return Err(Error::Config(format!(
                "sequence length {t} must be between 1 and the model's block size {}",
                model_cfg.block_size()
            )));
        }
        task.check_eval(cfg)?;
        agree_on_settings(task, cfg, par, world)?;
        let lead = world.rank() == 0;
        // Ranks may have chosen different run directories (a default named by
        // the clock, a temporary directory per process): rank 0's wins.
        // (A path crosses as UTF-8, so only rank 0's own path is taken whole.)
        let out_dir = match world.size() {
            1 => cfg.out_dir.clone(),
            _ => world
                .agree(cfg.out_dir.to_string_lossy().into_owned())?
                .into(),
        };
        let cfg = TrainConfig {
            out_dir,
            ..cfg.clone()
        };
        let mut train_loader = task.train_stream(&cfg)?;
        let steps = cfg
            .duration
            .steps(train_loader.batches_per_epoch(), cfg.grad_accum)
            .max(1);
        if let (Duration::Epochs(e), true) = (cfg.duration, steps > MAX_STEPS) {
            return Err(Error::Config(format!(
                "--epochs {e} is {steps} steps of this data, more than {MAX_STEPS}"
            )));
        }
        let sched = LrSchedule {
            max_lr: cfg.lr,
            min_lr: cfg.min_lr,
            warmup_steps: cfg.warmup_steps,
            total_steps: cfg.schedule_steps.unwrap_or(steps),
        };
        let spare = backend.clone_fresh();
        let bf16 = par.precision == Precision::Bf16;
        let (total_peak, peak_source) = agree_on_peak(&spare, &cfg, bf16, world)?;
        let mut strategy =
            parallel::build(backend, model_cfg.clone(), par, world, cfg.adamw, b, t)?;
        let start = restore(strategy.as_mut(), train_loader.as_mut(), task, &cfg, &spare)?;
        if start >= steps {
            return Err(Error::Input(format!(
                "the checkpoint is at step {start}; this run has {steps} steps: nothing left to train (extend it with --steps)"
            )));
        }
        Ok(Run {
            world,
            task,
            verbose: cfg.verbose && lead,
            model_cfg,
            par,
            strategy,
            spare,
            train_loader,
            sched,
            start,
            steps,
            total_peak,
            peak_source,
            lead,
            logs: None,
            pb: ProgressBar::hidden(),
            started: Instant::now(),
            tokens: 0,
            losses: Vec::new(),
            step_comm: CommStats::default(),
            history: Vec::new(),
            val_last: None,
            rank_peaks: vec![
                0;
                PeakRow::LEN * world.size() * (1 + usize::from(!par.offload.is_none()))
            ],
            stopped: false,
            record_failed: false,
            peak_rss_at_last_step: None,
            cfg,
        })
    }

    /// **Rank 0's.** The run directory, `run.json`, the step logs, the
    /// progress bar and the header lines.
    fn open_outputs(&mut self) -> Result<()> {
        if !self.lead {
            return Ok(());
        }
        let (cfg, steps, start) = (&self.cfg, self.steps, self.start);
        let horizon = self.sched.total_steps;
        let record = RunRecord {
            task: self.task.kind(),
            model: self.model_cfg.clone(),
            train: TrainConfig {
                resume: None,
                stop_after: None,
                fault: None,
                overwrite: false,
                schedule_steps: Some(horizon),
                ..cfg.clone()
            },
            parallel: self.par,
            dataset: self.task.data_name(),
            device: self.spare.name(),
            peak_flops: self.total_peak,
            segments: Vec::new(),
        };
        self.logs = Some(run_dir::open(
            &cfg.out_dir,
            record,
            start,
            steps,
            cfg,
            self.verbose,
        )?);
        self.pb = match &cfg.progress {
            Some(bar) => {
                bar.set_length(steps as u64);
                bar.clone()
            }
            None if self.verbose => metrics::progress_bar(steps as u64, "train"),
            None => ProgressBar::hidden(),
        };
        self.pb.set_position(start as u64);
        let m = &self.model_cfg;
        self.note(&format!(
            "training ({} task) {m} on {}",
            self.task.kind(),
            self.task.data_summary()
        ));
        self.note(&format!(
            "{} params | {} x {} tokens x {} accum per step | {steps} steps ({:.2} epochs) | {} on {}, tp {}{} | {}, peak {:.0} GFLOP/s in all ({})",
            m.num_params(),
            cfg.batch_size,
            cfg.seq_len,
            cfg.grad_accum,
            (steps * cfg.grad_accum) as f64 / self.train_loader.batches_per_epoch() as f64,
            self.par.strategy,
            metrics::count(self.par.world_size, "rank"),
            self.par.resolved().tp,
            match self.par.pipeline.stages {
                1 => String::new(),
                k => format!(", pp {k} ({})", self.par.pipeline),
            },
            self.spare.name(),
            self.total_peak / 1e9,
            self.peak_source
        ));
        if horizon < steps {
            self.note(&format!(
                "the learning-rate schedule ends at step {horizon}; later steps run at --min-lr {}",
                cfg.min_lr
            ));
        }
        Ok(())
    }

    /// A message above the progress bar (rank 0 with messages on).
    fn note(&self, msg: &str) {
        if self.verbose {
            metrics::say(&self.pb, msg)
        }
    }

    /// **Collective.** One optimizer step over `grad_accum` micro-batches,
    /// then every rank agrees whether to stop (a signal may reach only some
    /// ranks: mpirun forwards it to each process).
    fn train_step(&mut self, step: usize) -> Result<StepDone> {
        let cfg = &self.cfg;
        let fault = cfg
            .fault
            .filter(|f| f.rank == self.world.rank() && f.step == step);
        if let Some(e) = fault.and_then(|f| f.strike()) {
            return Err(e);
        }
        let bpe = self.train_loader.batches_per_epoch();
        let epochs_before = epochs_done(self.train_loader.position(), bpe);
        let micro: Vec<_> = (0..cfg.grad_accum)
            .map(|_| self.train_loader.next_batch(step))
            .collect();
        let epoch_ended = epochs_done(self.train_loader.position(), bpe) > epochs_before;
        let tokens = micro.iter().map(|b| self.task.tokens(b)).sum();
        let lr = self.sched.at(step);
        let t0 = Instant::now();
        let comm_before = self.strategy.comm_stats();
        let stats = match self.strategy.step(
            &micro,
            StepConfig {
                lr,
                grad_clip: cfg.grad_clip,
            },
        ) {
            Err(Error::Diverged(why)) => return Err(diverged(step, &why, cfg, false)),
            other => other?,
        };
        let seconds = t0.elapsed().as_secs_f64();
        (self.step_comm).add(&self.strategy.comm_stats().since(&comm_before));
        self.losses.push(stats.loss);
        self.tokens += tokens;
        let mut stop = [u32::from(
            INTERRUPTED.load(Ordering::SeqCst)
                || self.record_failed
                || cfg.stop_after.is_some_and(|n| step + 1 - self.start >= n),
        )];
        self.world.all_reduce(&mut stop)?;
        let stopping = stop[0] != 0 && step + 1 < self.steps;
        Ok(StepDone {
            loss: stats.loss,
            grad_norm: stats.grad_norm,
            lr,
            seconds,
            tokens,
            epoch_ended,
            is_last: step + 1 == self.steps || stopping,
            stopping,
        })
    }

    /// **Collective.** The validation figures every `eval_every` steps, at
    /// an epoch's end for a task that asks, and at the run's end. A stop
    /// adds none (it checkpoints at once: a scheduler's grace period is
    /// seconds, a validation pass can be minutes); one that lands where an
    /// evaluation was due anyway keeps it, so the run's records are the
    /// uninterrupted run's.
    fn evaluate_if_due(&mut self, step: usize, done: &StepDone) -> Result<Option<Eval>> {
        let every = self.cfg.eval_every;
        let epoch_end = done.epoch_ended && self.task.evaluates_each_epoch();
        let cadence = every > 0 && (step + 1).is_multiple_of(every);
        let at_end = done.is_last && !done.stopping;
        if !(at_end || epoch_end || cadence) {
            return Ok(None);
        }
        let v = self.task.evaluate(self.strategy.as_mut(), &self.cfg)?;
        // the update left weights that score no finite loss (the same on
        // every rank: the loss is the global batch's)
        if !v.loss.is_finite() {
            let why = format!("the validation loss after its update is {}", v.loss);
            return Err(diverged(step, &why, &self.cfg, true));
        }
        let scores = match (v.accuracy, v.f1) {
            (Some(a), Some(f1)) => {
                let of = self.task.kind().spec().scores_of;
                format!(", {of}accuracy {:.2}%, F1 {f1:.4}", 100.0 * a)
            }
            _ => String::new(),
        };
        self.note(&format!(
            "step {:>5}: train loss {:.4}, val loss {:.4}{scores}",
            step + 1,
            done.loss,
            v.loss
        ));
        self.val_last = Some(v);
        Ok(Some(v))
    }

    /// **Collective** (the whole model is gathered), then rank 0 samples:
    /// a sample every `sample_every` steps (the last step's comes with the summary).
    fn sample_if_due(&mut self, step: usize, done: &StepDone) -> Result<()> {
        let every = self.cfg.sample_every;
        if done.is_last || every == 0 || !(step + 1).is_multiple_of(every) {
            return Ok(());
        }
        let full = self.strategy.full_params()?;
        if self.lead {
            let s = self.task.sample(
                self.spare.clone_fresh(),
                &full,
                self.cfg.sample_tokens.min(200),
                self.cfg.seed.wrapping_add(step as u64),
            )?;
            self.note(&format!("--- sample at step {} ---\n{s}\n---", step + 1));
        }
        Ok(())
    }

    /// Every rank's peak rows as gathered: the device's, and under offload
    /// the host's (empty without).
    fn peak_rows(&self) -> (Vec<PeakRow>, Vec<PeakRow>) {
        let rows = PeakRow::rows(&self.rank_peaks);
        let per_rank = rows.len() / self.world.size();
        let host = rows.chunks(per_rank).filter_map(|c| c.get(1).copied());
        (
            rows.iter().step_by(per_rank).copied().collect(),
            host.collect(),
        )
    }

    /// **Collective** (every rank's peak memory is gathered), then rank 0
    /// writes the step's record and moves the progress bar (or, with no
    /// terminal, prints a line every `log_every` steps).
    fn record(&mut self, step: usize, done: &StepDone, val: Option<Eval>) -> Result<()> {
        let memory = self.strategy.memory();
        let row = |m: &MemoryReport| <[u64; PeakRow::LEN]>::from(m.peak_row());
        // one collective: under offload the host's row beside the device's
        // (zeros on a rank without host state)
        let mut mine = [0u64; 2 * PeakRow::LEN];
        mine[..PeakRow::LEN].copy_from_slice(&row(&memory));
        if let Some(host) = memory.host.as_deref() {
            mine[PeakRow::LEN..].copy_from_slice(&row(host));
        }
        let width = self.rank_peaks.len() / self.world.size();
        self.world
            .all_gather(&mine[..width], &mut self.rank_peaks)?;
        if !self.lead {
            return Ok(());
        }
        let tokens_per_s = done.tokens as f64 / done.seconds;
        let (rank_peak_bytes, rank_host_peak_bytes) = self.peak_rows();
        let (position, bpe) = (
            self.train_loader.position(),
            self.train_loader.batches_per_epoch(),
        );
        let record = StepRecord {
            step: step + 1,
            epoch: position.epoch as f64 + position.batch as f64 / bpe as f64,
            loss: done.loss,
            val_loss: val.map(|v| v.loss),
            val_accuracy: val.and_then(|v| v.accuracy),
            val_f1: val.and_then(|v| v.f1),
            val_examples: val.map(|v| v.examples),
            grad_norm: done.grad_norm,
            lr: done.lr,
            ms: done.seconds * 1e3,
            tokens_per_s,
            mfu: self.mfu(tokens_per_s),
            memory,
            rank_peak_bytes,
            rank_host_peak_bytes,
            comm: self.strategy.comm_stats(),
        };
        if let Some(logs) = self.logs.as_mut() {
            if let Err(e) = logs.write(&record) {
                if !self.record_failed {
                    metrics::say(
                        &self.pb,
                        &format!("{e}: the run stops after the next step with a checkpoint, as on SIGTERM"),
                    );
                }
                self.record_failed = true;
            }
        }
        self.history.push(record);
        self.pb
            .set_message(format!("loss {:.4} | {tokens_per_s:.0} tok/s", done.loss));
        let every = self.cfg.log_every;
        // a log without a bar: the run's first step (a sign of life and the
        // first speed), then every `log_every`
        let due = step == self.start || (step + 1).is_multiple_of(every);
        if self.pb.is_hidden() && every > 0 && due {
            let finished = step + 1 - self.start;
            let eta_s = self.started.elapsed().as_secs_f64() / finished as f64
                * (self.steps - step - 1) as f64;
            self.note(&format!(
                "step {:>5}/{}: loss {:.4} | lr {:.2e} | grad norm {:.3} | {tokens_per_s:.0} tokens/s | ETA {}",
                step + 1,
                self.steps,
                done.loss,
                done.lr,
                done.grad_norm,
                metrics::human_duration(eta_s)
            ));
        }
        self.pb.inc(1);
        Ok(())
    }

    /// **Collective** (the whole model is gathered), then rank 0 writes the
    /// model files of the weights after step `step` (0-based), refused
    /// where one is not finite (every rank holds them all). They come
    /// before the final checkpoint: a run whose final checkpoint exists is
    /// always readable. The gathered model is not kept through the
    /// checkpoint ([`Run::finish`] gathers it again).
    /// The task's report of an earlier model (a finished run extended) is
    /// removed first: a run stopped before it reports again has none, and
    /// `--resume` scores it, rather than keeping figures of another model.
    fn save_model(&mut self, step: usize) -> Result<()> {
        let full = self.strategy.full_params()?;
        if !full.iter().all(|x| x.is_finite()) {
            let why = "its update left non-finite weights; the model files were not written";
            return Err(diverged(step, why, &self.cfg, true));
        }
        if self.lead {
            if let Some(report) = self.task.report_file() {
                let path = self.cfg.out_dir.join(report);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(Error::io(&path, e))
                    }
                    _ => {}
                }
            }
            self.task
                .save_model(self.spare.clone_fresh(), &full, &self.cfg.out_dir)?;
        }
        Ok(())
    }

    /// **Collective.** A training-state checkpoint every `checkpoint_every`
    /// steps and at the last (each rank writes its own shard).
    fn checkpoint_if_due(&mut self, step: usize, done: &StepDone) -> Result<()> {
        let every = self.cfg.checkpoint_every;
        if !(done.is_last || (every > 0 && (step + 1).is_multiple_of(every))) {
            return Ok(());
        }
        let info = state::SaveInfo {
            step: step + 1,
            adam_step: (step + 1) as u32,
            loader: self.train_loader.position(),
            strategy: &self.par.strategy.to_string(),
            tp: self.par.resolved().tp,
            params_total: self.model_cfg.num_params(),
            model: &self.model_cfg,
            tokenizer: &self.task.tokenizer(),
            labels: self.task.labels(),
            data: self.task.fingerprint(),
            keep: self.cfg.keep_checkpoints,
            extra: self.task.vocab().map(|v| ("vocab.txt", v)),
        };
        let saved = state::save(
            &self.cfg.out_dir,
            &info,
            &self.strategy.owned_state()?,
            self.world,
        );
        if let Err(Error::Diverged(why)) = saved {
            return Err(diverged(step, &why, &self.cfg, true));
        }
        saved?;
        if done.stopping {
            self.note(&format!("stopped after step {}", step + 1));
        }
        Ok(())
    }

    /// MFU of `tokens_per_s` against the peak of all ranks together.
    fn mfu(&self, tokens_per_s: f64) -> f64 {
        metrics::mfu(
            self.model_cfg.flops_per_token(self.cfg.seq_len),
            tokens_per_s,
            self.total_peak,
        )
    }

    /// **Collective** (every rank's communication totals are gathered), then
    /// rank 0 samples from the final model (the strategy's memory freed
    /// first) and returns the summary.
    fn finish(mut self) -> Result<Option<TrainSummary>> {
        self.pb.finish_and_clear();
        let seconds = self.started.elapsed().as_secs_f64();
        let memory = self.strategy.memory();
        let comm = self.strategy.comm_stats();
        let (rank_comm_bytes, rank_comm_seconds) = (self.world)
            .gather(&(comm.total_bytes(), comm.seconds))?
            .into_iter()
            .unzip();
        // every rank of a pipeline has a timeline, no rank of anything else
        let mine = self.strategy.timeline();
        let timelines = match mine.is_empty() {
            true => Vec::new(),
            false => crate::parallel::pipeline::on_one_clock(self.world.gather(&mine)?),
        };
        let params = self.strategy.full_params()?;
        // a finished run's test split (a stopped run's waits for its end)
        let test = match self.stopped {
            true => None,
            false => self.task.test(self.strategy.as_mut(), &self.cfg)?,
        };
        if !self.lead {
            return Ok(None);
        }
        let tokens_per_s = self.tokens as f64 / seconds;
        let mfu = self.mfu(tokens_per_s);
        let (rank_peak_bytes, rank_host_peak_bytes) = self.peak_rows();
        drop(self.strategy);
        // a stopped run samples at its end, not on the way out
        let sample = match self.stopped {
            true => String::new(),
            false => {
                (self.task).sample(self.spare, &params, self.cfg.sample_tokens, self.cfg.seed)?
            }
        };
        if let Some(test) = test {
            let history = run_dir::read_metrics(&self.cfg.out_dir)?;
            let layout = self.par.layout_name();
            self.task
                .write_report(&self.cfg.out_dir, &history, test, &layout)?;
        }
        Ok(Some(TrainSummary {
            steps: self.start + self.losses.len(),
            peak_rss_at_last_step: self.peak_rss_at_last_step,
            first_loss: self.losses[0],
            final_loss: *self.losses.last().expect("at least one step"),
            val_loss: self.val_last.map_or(f32::NAN, |v| v.loss),
            val: self.val_last,
            test,
            tokens_per_s,
            mfu,
            seconds,
            memory,
            rank_peak_bytes,
            rank_host_peak_bytes,
            comm,
            step_comm: self.step_comm,
            rank_comm_bytes,
            rank_comm_seconds,
            losses: self.losses,
            history: self.history,
            params,
            sample,
            out_dir: self.cfg.out_dir,
            stopped: self.stopped,
            timelines,
        }))
    }
}

/// **Collective.** The peak FLOP/s of all ranks together, with
/// where it came from, and the CPU's matmul library every rank runs on
/// (rank 0's: the one kept with the peak). A stated `--peak-tflops` stands
/// for what the probe would measure, a CPU's or one GPU's, and is shared as
/// the measured peak is. Otherwise rank 0 takes it from the cache (or measures and caches it) before the other
/// ranks start work, so no rank shares the cores with the probe: thread
/// ranks of one process share its threads, so their peak is the peak of
/// all of those threads; ranks of their own (processes) each have the
/// peak of theirs, but processes sharing CPUs (mpirun's binding to a
/// socket or to nothing) count those CPUs once
/// ([`parallel::launch::cpu_process_shares`]); thread ranks on one device have that device's. Ranks
/// that are processes, or thread ranks of an NCCL group, count a device
/// each (one GPU per rank). With `bf16` (`--precision bf16`) the CPU's
/// hardware peak is its bf16 one where the products run in bf16
/// (`Peak::hardware_peak`).
fn agree_on_peak<B: Backend>(
    be: &B,
    cfg: &TrainConfig,
    bf16: bool,
    world: &dyn Comm,
) -> Result<(f64, String)> {
    let share = PeakShare::of(
        be.ranks_share_device(),
        world.shared_threads().is_some(),
        world.device_native().is_some(),
    );
    // processes on CPUs count the CPUs they can use, once each
    let ranks = match (share, be.ranks_share_device()) {
        (PeakShare::Own, false) => parallel::launch::cpu_process_shares(world.size()),
        _ => world.size() as f64,
    };
    let stated = cfg.peak_flops;
    let mut source = String::from("--peak-tflops");
    let (mut peak, mut matmul) = ([0.0f64; 1], None);
    if world.rank() == 0 {
        // thread ranks share this process's threads: the peak (and the
        // library kept with it) is that of all of them
        let threads = match world.shared_threads() {
            Some(threads) if share == PeakShare::Threads => threads,
            _ => rayon::current_num_threads(),
        };
        let total = parallel::launch::with_threads(threads, || match stated {
            Some(p) => {
                // the kept library still runs the products
                metrics::peak::cached(be);
                share.of_run(p, ranks)
            }
            None => {
                let p = metrics::peak::of(be, false);
                // the CPU's hardware peak where it is known: one figure per
                // machine and thread count, whatever load the probe met
                let flops = match &p.hardware_peak(bf16) {
                    Some(h) => {
                        source = format!(
                            "hardware: {}; products on {}; {}",
                            h.describe(),
                            blas::choice().describe(),
                            p.source
                        );
                        h.flops
                    }
                    None => {
                        source = format!("{}; {}", p.matmul_name(), p.source);
                        p.flops
                    }
                };
                share.of_run(flops, ranks)
            }
        })?;
        peak = [total];
        // read on rank 0 alone: a process that has not chosen chooses the
        // built-in when asked, and keeps its first choice
        matmul = Some(blas::choice());
    }
    world.broadcast(&mut peak, 0)?;
    // every rank on rank 0's library: no product of one run on another
    if let Some(choice) = world.agree(matmul)? {
        blas::set_choice(choice);
    }
    Ok((peak[0], source))
}

/// How the ranks of a run meet the peak the probe measures.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PeakShare {
    /// Thread ranks of one process on its CPU: the probe's peak is that of
    /// all its threads, a rank's a share.
    Threads,
    /// Thread ranks on one device: its peak is the run's.
    Device,
    /// Ranks that are processes, or thread ranks of an NCCL group (a GPU
    /// each): the probe's peak is one rank's.
    Own,
}

impl PeakShare {
    fn of(ranks_share_device: bool, thread_ranks: bool, nccl: bool) -> PeakShare {
        match (thread_ranks && !nccl, ranks_share_device) {
            (true, true) => PeakShare::Device,
            (true, false) => PeakShare::Threads,
            (false, _) => PeakShare::Own,
        }
    }

    /// The run's peak from the probe's `flops` over `ranks`.
    fn of_run(self, flops: f64, ranks: f64) -> f64 {
        match self {
            PeakShare::Threads | PeakShare::Device => flops,
            PeakShare::Own => flops * ranks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{difference, PeakShare};

    /// Two ranks' settings differ where a leaf does, named by its path,
    /// an f32 as it was written.
    #[test]
    fn the_first_difference_names_its_path_and_both_values() {
        let a = serde_json::json!({"settings": {"lr": 0.003f32, "seed": 1}, "data": "x"});
        let b = serde_json::json!({"settings": {"lr": 0.1f32, "seed": 1}, "data": "x"});
        let said = difference("", &a, &b);
        assert_eq!(
            said.as_deref(),
            Some("settings.lr is 0.1 (rank 0's: 0.003)")
        );
        assert_eq!(difference("", &a, &a), None);
        let c = serde_json::json!({"settings": {"lr": 0.003f32, "seed": 1}});
        let said = difference("", &a, &c);
        assert_eq!(said.as_deref(), Some("data is null (rank 0's: \"x\")"));
    }

    /// Thread ranks of an NCCL group have a GPU each: the probe measured
    /// one GPU, and the run's peak is the group's (it was taken as the
    /// whole run's, so MFU read world-size times too high).
    #[test]
    fn each_kind_of_rank_counts_the_peak_it_has() {
        let cases = [
            // (ranks share a device, thread ranks, NCCL) -> the run's of 8 over 4
            ((false, true, false), 8.0),
            ((true, true, false), 8.0),
            ((true, true, true), 32.0),
            ((true, false, true), 32.0),
            ((false, false, false), 32.0),
        ];
        for ((device, threads, nccl), want) in cases {
            let got = PeakShare::of(device, threads, nccl).of_run(8.0, 4.0);
            assert_eq!(got, want, "{:?}", (device, threads, nccl));
        }
    }
}
