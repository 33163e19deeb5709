//! `distgpt train`: a new run or a resumed one, prepared from its flags,
//! its config file or its run record, trained by the library's one run
//! driver, and reported.

use super::*;
use distgpt::train::Prepared;

#[derive(Args)]
pub(super) struct TrainArgs {
    /// Settings from a file: a TOML file whose keys are these flags'
    /// names (see configs/), or a run's run.json to repeat that run. Flags
    /// given here override the file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    pub(super) model: ModelArgs,
    /// What to train: a language model (GPT-2); a BERT masked language model
    /// from scratch (--model bert-tiny, bert-minilm, bert-base: on --data's
    /// WordPiece shards from `data prepare --tokenizer wordpiece`, or its
    /// characters, the embedded Shakespeare by default) or from a BERT
    /// folder (--init-from: its vocabulary); or a classifier
    /// fine-tuned from a Hugging Face BERT folder (--init-from) on a labelled
    /// set (--data, from `distgpt data prepare-spam` or any such directory).
    /// Default: mlm for a BERT preset, lm otherwise.
    #[arg(long, value_enum, help_heading = "Model")]
    task: Option<TaskKind>,
    #[command(flatten)]
    pub(super) parallel: ParallelArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Training data: a text file or a directory of token shards (default: embedded Shakespeare).
    #[arg(long, help_heading = "Data")]
    data: Option<PathBuf>,
    /// Tokenizer for text data.
    #[arg(long, value_enum, default_value = "char", help_heading = "Data")]
    tokenizer: TokenizerKind,
    /// --task classify: fine-tune on N training examples only (drawn with the seed).
    #[arg(long, help_heading = "Data")]
    train_examples: Option<usize>,
    /// Global batch: sequences per micro-step, split across the data-parallel ranks.
    #[arg(long, value_parser = positive(), default_value_t = 32, help_heading = "Data")]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size; BERT: 128, or a classifier's positions where fewer).
    #[arg(long, value_parser = positive(), help_heading = "Data")]
    seq_len: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, value_parser = micro_batches(), default_value_t = 1, help_heading = "Optimisation")]
    grad_accum: usize,
    /// Optimizer steps (--task classify: 3 epochs unless --steps or --epochs
    /// is given).
    #[arg(
        long,
        default_value_t = 800,
        conflicts_with = "epochs",
        help_heading = "Optimisation"
    )]
    steps: usize,
    /// Train for this many passes over the training split instead of --steps.
    #[arg(long, help_heading = "Optimisation")]
    epochs: Option<f64>,
    /// Peak learning rate.
    #[arg(
        long,
        default_value_t = 3e-3,
        help_heading = "Optimisation",
        allow_negative_numbers = true
    )]
    lr: f32,
    /// Final learning rate of the cosine decay (default: lr / 10).
    #[arg(long, help_heading = "Optimisation", allow_negative_numbers = true)]
    min_lr: Option<f32>,
    /// Linear warmup steps (--task classify: a tenth of the steps).
    #[arg(long, default_value_t = 50, help_heading = "Optimisation")]
    warmup: usize,
    /// AdamW's decoupled weight decay (matrices only, not biases or norms).
    #[arg(long, default_value_t = 0.1, help_heading = "Optimisation")]
    weight_decay: f32,
    /// AdamW's first-moment decay.
    #[arg(long, default_value_t = 0.9, help_heading = "Optimisation")]
    beta1: f32,
    /// AdamW's second-moment decay.
    #[arg(long, default_value_t = 0.99, help_heading = "Optimisation")]
    beta2: f32,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0, help_heading = "Optimisation")]
    grad_clip: f32,
    /// Validation every N steps (0: only at the end; a classifier's, at
    /// each epoch's end).
    #[arg(long, default_value_t = 100, help_heading = "Output")]
    eval_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 20, value_parser = positive(), help_heading = "Output")]
    eval_batches: usize,
    /// Print a sample every N steps (0: only at the end).
    #[arg(long, default_value_t = 0, help_heading = "Output")]
    sample_every: usize,
    /// When the output is not a terminal (no progress bar), print a line
    /// every N steps: loss, learning rate, gradient norm, tokens/s, ETA (0: none).
    #[arg(long, default_value_t = 10, help_heading = "Output")]
    log_every: usize,
    /// Tokens in the final sample (at most 65536; `generate` streams longer ones).
    #[arg(long, default_value_t = 500, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=65536), help_heading = "Output")]
    sample_tokens: usize,
    /// Seed of the initial weights, the data order and the samples.
    #[arg(long, value_parser = super::seed, allow_negative_numbers = true, default_value_t = 1337, help_heading = "Optimisation")]
    seed: u64,
    /// Run directory for metrics.jsonl, run.json, checkpoints and the weights
    /// (default: runs/<model>-<YYYYMMDD-HHMMSS>, with runs/latest pointing at it).
    #[arg(long, help_heading = "Output")]
    out: Option<PathBuf>,
    /// Also write the step records (loss, validation loss, accuracy and F1,
    /// grad norm, lr, tokens/s, MFU, memory) and the run's configuration as
    /// TensorBoard event files in DIR (`tensorboard --logdir DIR`).
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    tensorboard: Option<PathBuf>,
    /// Peak TFLOP/s of the device MFU is stated against, as `distgpt
    /// devices` prints it: this CPU's (its thread ranks share it; under
    /// mpirun a process's) or one GPU's (a rank each) (default: measured
    /// once per device and thread count, kept in ~/.cache/distgpt/peak.json).
    #[arg(long, value_parser = super::peak_tflops, help_heading = "Output")]
    peak_tflops: Option<f64>,
    #[command(flatten)]
    old_peak: super::OldPeakGflops,
    /// No progress bar or messages; the summary only.
    #[arg(long, help_heading = "Output")]
    quiet: bool,
    /// Write a training-state checkpoint every N steps (0: at the end and when stopped only).
    #[arg(long, default_value_t = 0, help_heading = "Checkpoints")]
    checkpoint_every: usize,
    /// Checkpoints to keep (the newest).
    #[arg(long, default_value_t = 3, help_heading = "Checkpoints")]
    keep_checkpoints: usize,
    /// Continue a run (its newest checkpoint, or a checkpoint directory
    /// RUN/checkpoints/step_N) with its recorded model, data, schedule and
    /// layout (bit-exact). Strategy, world size (within float tolerance), --steps/--epochs (to extend a finished run),
    /// --lr, --min-lr, --grad-clip, evaluation, sampling and checkpoint
    /// cadence may change; the model, data, batch shape, seed, warmup and
    /// AdamW betas and decay may not.
    #[arg(long, value_name = "RUN_OR_CHECKPOINT", help_heading = "Checkpoints")]
    resume: Option<PathBuf>,
    /// With --resume: continue from the checkpoint of this step instead of
    /// the newest (newer ones are moved to checkpoints/superseded/).
    #[arg(
        long,
        requires = "resume",
        conflicts_with = "overwrite",
        help_heading = "Checkpoints"
    )]
    from_step: Option<usize>,
    /// Empty --out first if it holds another run (without it, a non-empty --out is refused).
    #[arg(long, conflicts_with = "resume", help_heading = "Output")]
    overwrite: bool,
    /// Start from these weights (a run directory or a Hugging Face GPT-2 folder):
    /// its model shape and tokenizer are the run's (--model, --n-layer and
    /// the like, and --tokenizer, are refused beside it).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "resume",
        help_heading = "Checkpoints"
    )]
    init_from: Option<PathBuf>,
    /// Stop (with a checkpoint) after this many steps of this invocation.
    #[arg(long, value_parser = positive(), help_heading = "Checkpoints")]
    stop_after: Option<usize>,
    /// Testing aid: make this rank fail (with --fail-step).
    #[arg(long, requires = "fail_step", hide = true)]
    fail_rank: Option<usize>,
    /// Testing aid: the step (0-based) at which --fail-rank fails.
    #[arg(long, requires = "fail_rank", hide = true)]
    fail_step: Option<usize>,
    /// Testing aid: how --fail-rank fails (stop and hang need --comm mpi).
    #[arg(long, value_enum, default_value_t, requires = "fail_rank", hide = true)]
    fail_how: FaultKind,
}

impl TrainArgs {
    /// The run settings the flags give: a new run's before its task's
    /// defaults and its data's, what a resume takes of them.
    fn settings(&self) -> TrainConfig {
        TrainConfig {
            batch_size: self.batch_size,
            grad_accum: self.grad_accum,
            duration: match self.epochs {
                Some(e) => Duration::Epochs(e),
                None => Duration::Steps(self.steps),
            },
            lr: self.lr,
            min_lr: self.min_lr.unwrap_or(train::default_min_lr(self.lr)),
            warmup_steps: self.warmup,
            adamw: AdamWConfig {
                beta1: self.beta1,
                beta2: self.beta2,
                eps: 1e-8,
                weight_decay: self.weight_decay,
            },
            grad_clip: self.grad_clip,
            eval_every: self.eval_every,
            eval_batches: self.eval_batches,
            sample_every: self.sample_every,
            log_every: self.log_every,
            sample_tokens: self.sample_tokens,
            seed: self.seed,
            link_latest: self.out.is_none(),
            tensorboard: self.tensorboard.as_deref().map(absolute),
            peak_flops: self.old_peak.or_stated(self.peak_tflops).map(|t| t * 1e12),
            verbose: !self.quiet,
            checkpoint_every: self.checkpoint_every,
            keep_checkpoints: self.keep_checkpoints,
            // absolute, as --tensorboard, so run.json names the same files
            // from any directory
            init_from: self.init_from.as_deref().map(absolute),
            data: self.data.as_deref().map(absolute),
            train_examples: self.train_examples,
            overwrite: self.overwrite,
            ..TrainConfig::default()
        }
    }
}

/// Why a resumed run keeps its model and data.
const MODEL_AND_DATA: &str = "the checkpoint holds this run's model trained on its data; to train those weights on something else start a new run with --init-from RUN";

/// Flags a resumed run refuses, each with why: what `--init-from` fixes,
/// and more.
pub(super) const FIXED_ON_RESUME: [(&[&str], &str); 8] = [
    (&config::FIXED_BY_INIT, MODEL_AND_DATA),
    (&["data"], MODEL_AND_DATA),
    (
        &["batch_size", "seq_len", "grad_accum"],
        "the checkpoint's data position counts batches of the run's shape",
    ),
    (&["seed"], "the run's data order comes from its seed"),
    (
        &["train_examples"],
        "the run's training examples were drawn once, with its seed",
    ),
    (
        &["warmup", "beta1", "beta2", "weight_decay"],
        "the optimizer state was built with the run's settings",
    ),
    (&["out"], "a resumed run continues in its own directory"),
    (
        &["init_from", "overwrite"],
        "a resumed run starts from its checkpoint",
    ),
];

/// Refuses the flags a resumed run takes from its record, each with why.
pub(super) fn refuse_fixed_on_resume(given: &[String]) -> Result<()> {
    for (flags, why) in FIXED_ON_RESUME {
        if let Some(f) = flags.iter().find(|f| given.iter().any(|g| g == *f)) {
            bail!(
                "--{} cannot change when resuming: {why}",
                f.replace('_', "-")
            );
        }
    }
    Ok(())
}

/// A new run from the flags, with its task's defaults where a flag is not given.
pub(super) fn new_run(a: &TrainArgs, given: &[String], task: TaskKind) -> Result<Prepared> {
    let set = |flag: &str| given.iter().any(|g| g == flag);
    let fixed = config::FIXED_BY_INIT.iter().find(|f| set(f));
    // every task: a BERT folder's shape is its config.json's as a GPT-2's
    // is its model.json's
    if let (Some(dir), Some(f)) = (&a.init_from, fixed) {
        bail!(
            "--{} cannot be given with --init-from: the model's shape and tokenizer are those of {}",
            f.replace('_', "-"),
            dir.display()
        );
    }
    let spec = task.spec();
    let model = |vocab| {
        a.model.resolve_family(vocab).map_err(|e| {
            e.downcast::<distgpt::error::Error>()
                .unwrap_or_else(|e| distgpt::error::Error::Config(format!("{e:#}")))
        })
    };
    let inputs = train::spec::TaskInputs {
        model: &model,
        init_from: a.init_from.as_deref(),
        data: a.data.as_deref(),
        tokenizer: a.tokenizer,
        tokenizer_given: set("tokenizer"),
        seq_len: a.seq_len,
        block_size: a.model.block_size,
        train_examples: a.train_examples,
        seed: a.seed,
    };
    let (data, seq_len) = TaskData::new(task, &inputs)?;
    let out_name = spec.run_name.unwrap_or(&a.model.model);
    let mut cfg = TrainConfig {
        seq_len,
        out_dir: a
            .out
            .clone()
            .unwrap_or_else(|| train::default_run_dir(out_name)),
        tokenizer: if spec.has("tokenizer") {
            a.tokenizer
        } else {
            TokenizerKind::Char
        },
        ..a.settings()
    };
    spec.apply_defaults(&mut cfg, set);
    if let (TaskData::Classify(t), false) = (&data, set("warmup")) {
        cfg.warmup_steps = t.default_warmup(&cfg);
    }
    Ok(Prepared {
        data,
        cfg,
        par: a.parallel.config(),
        lock: None,
    })
}

/// The run recorded in a run directory, set to continue from one of its
/// checkpoints (in `cfg.out_dir`, from `cfg.resume`), with the flags a
/// resume may change applied, on its own kind of device unless --device is
/// given. Returns it with the checkpoint's step.
pub(super) fn resumed_run(a: &mut TrainArgs, given: &[String]) -> Result<(Prepared, usize)> {
    let path = a.resume.clone().expect("resuming");
    if a.from_step.is_some() && path.join("index.json").exists() {
        bail!(
            "--from-step picks a checkpoint of a run directory; {} is already one checkpoint",
            path.display()
        );
    }
    let found = train::resume::find(&path, a.from_step)?;
    let given: Vec<String> = given
        .iter()
        .filter(|id| !as_recorded(a, id, &found.record))
        .cloned()
        .collect();
    refuse_fixed_on_resume(&given)?;
    if let Some(t) = a.task.filter(|&t| t != found.record.task) {
        bail!(
            "--task {t}: {} is a --task {} run",
            found.dir.display(),
            found.record.task
        );
    }
    if !given.iter().any(|g| g == "device") {
        a.device.device = recorded_device(&found.record.device);
    }
    let step = found.index.step;
    Ok((
        found.prepare(&a.settings(), a.parallel.config(), &given)?,
        step,
    ))
}

/// Whether the flag `id`, given with `--resume`, says what the run `r`
/// records: a fixed setting repeated as it is changes nothing, so a run's
/// own command line (or its run.json as --config) resumes it.
fn as_recorded(a: &TrainArgs, id: &str, r: &train::run_dir::RunRecord) -> bool {
    let t = &r.train;
    let same = |x: Option<&Path>, y: Option<&Path>| {
        let canon = |p: Option<&Path>| p.map(|p| std::fs::canonicalize(p).unwrap_or(p.into()));
        canon(x) == canon(y)
    };
    match id {
        "batch_size" => a.batch_size == t.batch_size,
        "seq_len" => a.seq_len == Some(t.seq_len),
        "grad_accum" => a.grad_accum == t.grad_accum,
        "seed" => a.seed == t.seed,
        "train_examples" => a.train_examples == t.train_examples,
        "warmup" => a.warmup == t.warmup_steps,
        "beta1" => a.beta1 == t.adamw.beta1,
        "beta2" => a.beta2 == t.adamw.beta2,
        "weight_decay" => a.weight_decay == t.adamw.weight_decay,
        "tokenizer" => a.tokenizer == t.tokenizer,
        "data" => same(a.data.as_deref(), t.data.as_deref()),
        "init_from" => same(a.init_from.as_deref(), t.init_from.as_deref()),
        "out" => same(a.out.as_deref(), Some(&t.out_dir)),
        "model" | "n_layer" | "n_head" | "n_embd" | "block_size" => a
            .model
            .family_shape(Some(r.model.vocab_size()))
            .is_ok_and(|m| r.task.as_trained(m, &r.model) == r.model),
        _ => false,
    }
}

/// The kind of device a run record names (as the backend does: `cpu (2
/// threads)`, `opencl (NAME)`).
fn recorded_device(named: &str) -> DeviceKind {
    if named.starts_with("opencl") {
        DeviceKind::Opencl
    } else if named.starts_with("cuda") {
        DeviceKind::Cuda
    } else {
        DeviceKind::Cpu
    }
}

/// `p` from the root (links and `..` resolved where it exists), or as
/// given where the current directory is unknown.
fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p)
        .or_else(|_| std::path::absolute(p))
        .unwrap_or_else(|_| p.to_path_buf())
}

/// Resuming a run whose final checkpoint exists: there is nothing to train,
/// but its model files may be missing, cut short or stale (killed between
/// the two), and they are rewritten from that checkpoint; and a run stopped
/// while it scored its test split is scored (on `device`) and reported.
pub(super) fn finish_completed(p: &Prepared, step: usize, device: &DeviceArgs) -> Result<Outcome> {
    let (run_dir, ckpt) = (&p.cfg.out_dir, p.cfg.resume.as_deref().expect("resuming"));
    let _lock = train::run_dir::lock(run_dir)?;
    let rewritten = match files::verify_model_files(run_dir, &p.data.model()) {
        Ok(()) => false,
        Err(why) => {
            let vocab = match &p.data {
                TaskData::Classify(t) => Some(t.vocab_file()),
                _ => None,
            };
            consolidate(ckpt, run_dir, vocab)?;
            distgpt::outln!(
                "{} finished at step {step}, but its model files were unreadable ({why}); rewrote them from {}",
                run_dir.display(),
                ckpt.display()
            );
            true
        }
    };
    let unreported = p
        .data
        .with_task::<Cpu, _>(|task| task.report_file())
        .filter(|f| !run_dir.join(f).exists());
    let Some(report) = unreported else {
        if rewritten {
            return Ok(Outcome::Done);
        }
        bail!(
            "{} finished at step {step}: nothing left to train (extend it with --steps N, N > {step})",
            run_dir.display()
        );
    };
    let params = checkpoint::state::load(ckpt)?.params;
    let test = device.run(ScoreTest(p, &params))?;
    let history = train::run_dir::read_metrics(run_dir)?;
    let layout = p.par.layout_name();
    p.data
        .with_task::<Cpu, _>(|task| task.write_report(run_dir, &history, test, &layout))?;
    distgpt::outln!(
        "{} finished at step {step} but was stopped while scoring its test split: scored it (loss {:.4}{}) and wrote {}",
        run_dir.display(),
        test.loss,
        test.accuracy
            .map_or(String::new(), |a| format!(", accuracy {:.2}%", 100.0 * a)),
        run_dir.join(report).display()
    );
    Ok(Outcome::Done)
}

/// Refuses thread ranks whose planned memory for `w` exceeds what this
/// machine has free (train's and bench's).
pub(super) fn check_memory(w: &distgpt::plan::Workload, par: ParallelConfig) -> Result<()> {
    let Some(free) = metrics::available_memory_bytes() else {
        return Ok(());
    };
    let per_rank = distgpt::plan::memory_plan(w, par, distgpt::plan::Precision::Fp32).total();
    // Each thread rank also holds a worker pool, communication slots and
    // scratch the plan does not itemise.
    let need = par.world_size as f64 * (1.25 * per_rank + 16.0 * 1024.0 * 1024.0);
    if need > free as f64 {
        let h = |b: f64| metrics::human_bytes(b as u64);
        bail!(
            "{} {} about {} ({} each by `distgpt plan`), but {} is available: use fewer ranks, a smaller batch or model, or --recompute",
            metrics::count(par.world_size, "thread rank"),
            if par.world_size == 1 { "needs" } else { "need" },
            h(need),
            h(per_rank),
            h(free as f64)
        );
    }
    Ok(())
}

/// SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 (which mpirun forwards to every
/// rank without killing them) all mean: finish the step, checkpoint, stop. Later
/// signals are reported and ignored, so a save is never cut short by one.
pub(super) fn handle_stop_signals() -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGUSR1, SIGUSR2])
        .context("installing the signal handlers")?;
    std::thread::spawn(move || {
        for sig in signals.forever() {
            let name = match sig {
                SIGINT => "SIGINT",
                SIGTERM => "SIGTERM",
                SIGUSR1 => "SIGUSR1",
                _ => "SIGUSR2",
            };
            if train::INTERRUPTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
                distgpt::errln!("\n{name}: already stopping; the checkpoint is being written (SIGKILL would lose only the current step)");
            } else {
                distgpt::errln!(
                    "\n{name}: interrupted: finishing the step and writing a checkpoint"
                );
            }
        }
    });
    Ok(())
}

/// `train`: a new run of any task, or a recorded run resumed, through the one run driver.
pub(super) fn run_train(
    mut a: TrainArgs,
    given: &[String],
    threads: Option<usize>,
) -> Result<Outcome> {
    if let Some(p) = a.data.as_ref().filter(|p| !p.exists()) {
        bail!("data path {} does not exist", p.display());
    }
    let mut prep = match &a.resume {
        Some(_) => {
            let (prep, step) = resumed_run(&mut a, given)?;
            prep.data.kind().spec().refuse(given)?;
            if step >= prep.total_steps()? {
                return finish_completed(&prep, step, &a.device);
            }
            // once, not once a process under mpirun
            if distgpt::train::run_dir::lead_process() {
                distgpt::errln!(
                    "resuming {} from {} as {} on {}",
                    prep.cfg.out_dir.display(),
                    prep.cfg.resume.as_deref().expect("resuming").display(),
                    prep.par.strategy,
                    metrics::count(prep.par.world_size, "rank")
                );
            }
            prep
        }
        None => {
            let bert = BertConfig::preset(&a.model.model).is_some();
            let task = a
                .task
                .unwrap_or(if bert { TaskKind::Mlm } else { TaskKind::Lm });
            if task == TaskKind::Lm && bert {
                bail!(
                    "{} is a BERT preset: --task mlm pretrains it (the default for BERT), --task lm trains GPT-2 models",
                    a.model.model
                );
            }
            task.spec().refuse(given)?;
            let prep = new_run(&a, given, task)?;
            if let Some(file) = &a.config {
                config::check_recorded_data(file, prep.cfg.data.as_deref(), |recorded| {
                    prep.data.with_task::<Cpu, _>(|t| {
                        (t.trained_on(recorded), t.fingerprint().to_string())
                    })
                })?;
            }
            prep
        }
    };
    let cfg = &mut prep.cfg;
    cfg.stop_after = a.stop_after;
    cfg.fault = a.fail_rank.zip(a.fail_step).map(|(rank, step)| Fault {
        rank,
        step,
        how: a.fail_how,
    });
    let whole_process = matches!(a.fail_how, FaultKind::Stop | FaultKind::Hang);
    if whole_process && a.parallel.comm != CommKind::Mpi {
        bail!("--fail-how stop and hang stop a whole process: they need --comm mpi");
    }
    cfg.validate()?;
    let par = prep.par;
    let model = prep.data.model();
    par.resolved().validate(&model, cfg.batch_size)?;
    par.pipeline.check_micro_batches(cfg.grad_accum)?;
    if a.parallel.comm == CommKind::Local {
        let w = distgpt::plan::Workload {
            model: model.clone(),
            batch: cfg.batch_size,
            seq_len: cfg.seq_len,
            grad_accum: cfg.grad_accum,
            cpu_threads: a.device.is_cpu().then(rayon::current_num_threads),
        };
        check_memory(&w, par.resolved())?;
    }
    handle_stop_signals()?;
    let launcher = ParallelArgs {
        world_size: par.world_size,
        ..a.parallel.clone()
    };
    let prep = &prep;
    let Some(s) = a.device.run(TrainOn(prep, &launcher, &a.device))?.flatten() else {
        let stopped = train::INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst);
        return Ok(if stopped {
            Outcome::Stopped
        } else {
            Outcome::Done
        });
    };
    let resume = resume_command(&s.out_dir, &launcher, &a.device, threads);
    report_run(prep, &s, &resume)
}

/// A run's test split scored with `params` on the backend `--device` chooses.
struct ScoreTest<'a>(&'a Prepared, &'a [f32]);

impl OnBackend for ScoreTest<'_> {
    type Out = Result<train::Eval>;
    fn run<B: Backend>(self, be: B) -> Result<train::Eval> {
        let (ScoreTest(p, params), threads) = (self, rayon::current_num_threads());
        Ok(p.data
            .with_task(|task| train::evaluate_params(be, task, params, &p.cfg, threads, true))?)
    }
}

/// A run's ranks launched as `--comm` says on the backend `--device`
/// chooses: rank 0's summary (None on the other MPI ranks, or stopped).
struct TrainOn<'a>(&'a Prepared, &'a ParallelArgs, &'a DeviceArgs);

impl OnBackend for TrainOn<'_> {
    type Out = Result<Option<Option<train::TrainSummary>>>;
    fn run<B: Backend>(self, be: B) -> Self::Out {
        let TrainOn(prep, launcher, device) = self;
        let ran = launcher.launch(device)?.run(|world| {
            let be = distgpt::comm::backend_for(&be, world)?;
            (prep.data).with_task(|task| train::train_rank(be, task, &prep.cfg, prep.par, world))
        });
        Ok(ran?)
    }
}

/// The closing lines of a run (rank 0's summary); `resume` is the command
/// that continues a stopped one.
pub(super) fn report_run(
    prep: &Prepared,
    s: &train::TrainSummary,
    resume: &str,
) -> Result<Outcome> {
    // --quiet: the summary only
    if prep.cfg.verbose && !s.sample.is_empty() {
        distgpt::outln!("--- sample ---\n{}\n--------------", s.sample);
    }
    let what = prep.data.kind().spec().loss;
    let from = s.steps - s.losses.len();
    // a run stopped before its first evaluation has none (a stop does not
    // evaluate)
    let val = match s.val {
        Some(v) => format!("val loss {:.4}", v.loss),
        None => "not evaluated yet".into(),
    };
    distgpt::outln!(
        "steps {from}..{} in {:.1} s | {what} {:.4} -> {:.4} | {val} | {:.0} tokens/s, MFU {:.1}% (wall clock, evaluation included)",
        s.steps,
        s.seconds,
        s.first_loss,
        s.final_loss,
        s.tokens_per_s,
        100.0 * s.mfu
    );
    if let Some(note) = metrics::mfu_above_peak(s.mfu, prep.cfg.peak_flops.is_some()) {
        distgpt::errln!("note: {note}");
    }
    if let Some(t) = s.test {
        distgpt::outln!(
            "test: loss {:.4}, accuracy {:.2}%, F1 {:.4} on {} examples",
            t.loss,
            100.0 * t.accuracy.unwrap_or(0.0),
            t.f1.unwrap_or(0.0),
            t.examples
        );
    }
    distgpt::outln!("peak memory (rank 0): {}", metrics::memory_line(&s.memory));
    // the kernel's RSS counters are approximate: a later VmHWM can read
    // below the one taken at the last step, which is then the peak
    let rss = metrics::peak_rss_bytes().map(|r| r.max(s.peak_rss_at_last_step.unwrap_or(0)));
    if let Some(rss) = rss {
        distgpt::outln!(
            "peak RSS of rank 0's process: {}{} (its ranks with what the categories leave out: data, workspaces, thread stacks, the allocator)",
            metrics::human_bytes(rss),
            s.peak_rss_at_last_step.map_or(String::new(), |at| format!(
                ", {} when the last step was done",
                metrics::human_bytes(at)
            ))
        );
    }
    if s.rank_peak_bytes.len() > 1 {
        let h = metrics::human_bytes;
        for (r, p) in s.rank_peak_bytes.iter().enumerate() {
            // under offload, what the rank holds on the host (stages differ)
            let host = s.rank_host_peak_bytes.get(r).map_or(String::new(), |p| {
                format!(
                    " | host (offload) {} (params {}, grads {}, optimizer {})",
                    h(p.total),
                    h(p.params),
                    h(p.grads),
                    h(p.optimizer)
                )
            });
            distgpt::outln!(
                "rank {r}: peak {} (params {}, grads {}, optimizer {}, activations {}, other {}){host} | sent {} in {:.2} s of collectives",
                h(p.total),
                h(p.params),
                h(p.grads),
                h(p.optimizer),
                h(p.activations),
                h(p.other),
                h(s.rank_comm_bytes[r]),
                s.rank_comm_seconds[r]
            );
        }
    }
    let files = prep.data.with_task::<Cpu, _>(|t| t.model_files());
    distgpt::outln!(
        "run directory: {} (model: {files}; metrics.jsonl, metrics.csv, run.json, checkpoints/)",
        s.out_dir.display()
    );
    if s.stopped {
        distgpt::errln!(
            "stopped after step {} with a checkpoint: continue with `{}`",
            s.steps,
            resume
        );
        return Ok(Outcome::Stopped);
    }
    Ok(Outcome::Done)
}

/// The command that continues a stopped run, launched as this one was
/// (`threads` where `--threads` was given: a CPU's sums follow it, and a
/// resume is bit for bit only on as many): the run directory says
/// everything else.
pub(super) fn resume_command(
    dir: &Path,
    par: &ParallelArgs,
    device: &DeviceArgs,
    threads: Option<usize>,
) -> String {
    let mut words = vec!["distgpt".to_string()];
    if let Some(n) = threads {
        words.extend(["--threads".into(), n.to_string()]);
    }
    words.extend(["train".into(), "--resume".into()]);
    words.push(shell_word(&dir.display().to_string()));
    if par.comm != CommKind::Local {
        words.extend(["--comm".into(), par.comm.to_string()]);
    }
    let ordinal = match device.device {
        DeviceKind::Cpu => None,
        DeviceKind::Opencl => Some(("opencl", "--opencl-device", device.opencl_device)),
        DeviceKind::Cuda => Some(("cuda", "--cuda-device", device.cuda_device)),
    };
    if let Some((name, flag, n)) = ordinal {
        words.extend(["--device".into(), name.into()]);
        if n != 0 {
            words.extend([flag.into(), n.to_string()]);
        }
    }
    if par.comm != CommKind::Local && launch::under_mpirun() {
        words.splice(
            0..0,
            ["mpirun".into(), "-np".into(), par.world_size.to_string()],
        );
    }
    words.join(" ")
}

/// `w` as one shell word: quoted unless it is plain.
pub(super) fn shell_word(w: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:=,+@%".contains(c);
    if !w.is_empty() && w.chars().all(plain) {
        w.into()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_in_a_printed_command_is_one_shell_word() {
        assert_eq!(shell_word("runs/tiny-20261125"), "runs/tiny-20261125");
        assert_eq!(shell_word("/tmp/hint dir"), "'/tmp/hint dir'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }

    #[test]
    fn a_resumed_run_refuses_what_init_from_fixes_and_its_data() {
        let refused = |flag: &str| {
            let e = refuse_fixed_on_resume(&[flag.to_string()]).unwrap_err();
            e.to_string()
        };
        for flag in config::FIXED_BY_INIT.iter().chain(&["data"]) {
            let said = refused(flag);
            let want = format!("--{} cannot change when resuming", flag.replace('_', "-"));
            assert!(said.starts_with(&want), "{said}");
            assert!(
                said.contains("holds this run's model trained on its data"),
                "{said}"
            );
        }
        assert!(refused("seed").contains("data order comes from its seed"));
        assert!(refuse_fixed_on_resume(&["lr".to_string(), "epochs".to_string()]).is_ok());
    }
}
