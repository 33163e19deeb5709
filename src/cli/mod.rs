//! Command-line interface: clap commands turned into library configs.

mod bench;
mod compare;
mod plan;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use distgpt::backend::cpu::Cpu;
use distgpt::checkpoint;
use distgpt::comm::Comm;
use distgpt::data::{self, Dataset, TokenizerKind};
use distgpt::infer::generate::{generate_packed, SampleConfig};
use distgpt::metrics;
use distgpt::model::{AdamWConfig, GptConfig};
use distgpt::parallel::{launch, ParallelConfig, StrategyKind};
use distgpt::train::{self, Duration, Fault, TrainConfig};
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "distgpt", version, about = "Train GPT-2-family models and compare parallel strategies", long_about = None)]
pub struct Cli {
    /// Worker threads (default: every core).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no arguments: a Shakespeare character model on the embedded corpus).
    Train(Box<TrainArgs>),
    /// Sample text from a trained run directory.
    Generate(GenerateArgs),
    /// Prepare data.
    #[command(subcommand)]
    Data(DataCommand),
    /// Measure training throughput, MFU and peak memory on synthetic tokens.
    Bench(bench::BenchArgs),
    /// Train a matrix of strategies x world sizes x batch sizes and write a
    /// report: results.json/.csv, report.md and PNG/SVG figures.
    Compare(Box<compare::CompareArgs>),
    /// Predict per-rank memory and step time of every strategy for a model,
    /// world size, device and network, and recommend the fastest that fits.
    Plan(Box<plan::PlanArgs>),
    /// Write a run's model as a Hugging Face folder (config.json + model.safetensors).
    Export(ExportArgs),
    /// Validation loss and perplexity of a model (a run directory or a Hugging Face folder).
    Eval(EvalArgs),
    /// Training-state checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize a text file (default: the embedded Shakespeare) into llm.c token shards with a train/val split.
    Prepare(PrepareArgs),
}

/// Model shape: a preset, with any field overridden.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Model preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, shakespeare-char, shakespeare-char-small, tiny.
    #[arg(long, default_value = "shakespeare-char-small")]
    model: String,
    #[arg(long)]
    n_layer: Option<usize>,
    #[arg(long)]
    n_head: Option<usize>,
    #[arg(long)]
    n_embd: Option<usize>,
    /// Maximum sequence length (positions).
    #[arg(long)]
    block_size: Option<usize>,
}

impl ModelArgs {
    pub fn model_name(&self) -> &str {
        &self.model
    }

    /// The preset with overrides and the given vocabulary, validated.
    pub fn resolve(&self, vocab_size: Option<usize>) -> Result<GptConfig> {
        let mut c = GptConfig::preset(&self.model)?;
        c.n_layer = self.n_layer.unwrap_or(c.n_layer);
        c.n_head = self.n_head.unwrap_or(c.n_head);
        c.n_embd = self.n_embd.unwrap_or(c.n_embd);
        c.block_size = self.block_size.unwrap_or(c.block_size);
        c.vocab_size = vocab_size.unwrap_or(c.vocab_size);
        c.validate()?;
        Ok(c)
    }
}

/// How ranks are arranged and started.
#[derive(Args, Clone)]
pub struct ParallelArgs {
    /// Parallel strategy.
    #[arg(long, value_enum, default_value = "single")]
    strategy: StrategyKind,
    /// Number of ranks (threads with --comm local; must equal mpirun's -np with --comm mpi).
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    /// Tensor-parallel group size (strategy tp: default the whole world; ddp with --tp: a dp x tp mesh).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Recompute each block's activations in the backward instead of keeping them.
    #[arg(long)]
    recompute: bool,
    /// local: ranks are threads of this process; mpi: ranks are processes started by mpirun.
    #[arg(long, value_enum, default_value = "local")]
    comm: CommKind,
    /// Seconds a collective may wait for the other ranks before failing.
    #[arg(long, default_value_t = 120.0)]
    comm_timeout: f64,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CommKind {
    Local,
    Mpi,
}

/// How `generate` (and `bench --generate`) store the weights they stream.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DecodeWeightsArg {
    /// The model's fp32 weights: the same logits as the training forward.
    F32,
    /// Rounded to bfloat16 once: half the bytes per token, logits within
    /// bf16 rounding of fp32 (arithmetic stays fp32).
    Bf16,
}

impl DecodeWeightsArg {
    fn format(self) -> distgpt::backend::WeightFormat {
        match self {
            DecodeWeightsArg::F32 => distgpt::backend::WeightFormat::F32,
            DecodeWeightsArg::Bf16 => distgpt::backend::WeightFormat::Bf16,
        }
    }
}

impl ParallelArgs {
    fn config(&self) -> ParallelConfig {
        ParallelConfig {
            strategy: self.strategy,
            world_size: self.world_size,
            tp: self.tp,
            recompute: self.recompute,
        }
    }

    fn timeout(&self) -> Result<std::time::Duration> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            bail!("--comm-timeout must be a positive number of seconds");
        }
        Ok(std::time::Duration::from_secs_f64(self.comm_timeout))
    }

    /// Runs `f` on every rank: threads here, or this process's rank under mpirun.
    /// Returns rank 0's result (None on the other MPI ranks).
    fn launch<R: Send>(
        &self,
        threads: usize,
        f: impl Fn(&dyn Comm) -> distgpt::error::Result<R> + Sync,
    ) -> Result<Option<R>> {
        let timeout = self.timeout()?;
        match self.comm {
            CommKind::Local => {
                let mut out =
                    launch::run_local(self.world_size, threads, timeout, |c| f(c.as_ref()))?;
                Ok(Some(out.swap_remove(0)))
            }
            CommKind::Mpi => mpi_launch(timeout, f),
        }
    }
}

#[cfg(feature = "mpi")]
fn mpi_launch<R>(
    timeout: std::time::Duration,
    f: impl Fn(&dyn Comm) -> distgpt::error::Result<R>,
) -> Result<Option<R>> {
    let comm = distgpt::comm::mpi::MpiComm::init(timeout)?;
    match f(&comm) {
        Ok(r) => Ok((comm.rank() == 0).then_some(r)),
        Err(e) => comm.abort(&e.to_string()),
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_launch<R>(
    _: std::time::Duration,
    _: impl Fn(&dyn Comm) -> distgpt::error::Result<R>,
) -> Result<Option<R>> {
    bail!("this distgpt was built without MPI: rebuild with `cargo build --release --features mpi` (needs libopenmpi-dev and libclang-dev)")
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    parallel: ParallelArgs,
    /// Training data: a text file or a directory of token shards (default: embedded Shakespeare).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokenizer for text data.
    #[arg(long, value_enum, default_value = "char")]
    tokenizer: TokenizerKind,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 800, conflicts_with = "epochs")]
    steps: usize,
    /// Train for this many passes over the training split instead of --steps.
    #[arg(long)]
    epochs: Option<f64>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Final learning rate of the cosine decay (default: lr / 10).
    #[arg(long)]
    min_lr: Option<f32>,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f32,
    #[arg(long, default_value_t = 0.9)]
    beta1: f32,
    #[arg(long, default_value_t = 0.99)]
    beta2: f32,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f32,
    /// Validation every N steps (0: only at the end).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 20)]
    eval_batches: usize,
    /// Print a sample every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    sample_every: usize,
    /// Tokens in the final sample.
    #[arg(long, default_value_t = 500)]
    sample_tokens: usize,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Run directory for metrics.jsonl, run.json and the weights (default: runs/<model>-<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Declared peak GFLOP/s for MFU (default: measured at start).
    #[arg(long)]
    peak_gflops: Option<f64>,
    /// No progress bar or messages; the summary only.
    #[arg(long)]
    quiet: bool,
    /// Write a training-state checkpoint every N steps (0: at the end and on Ctrl-C only).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Checkpoints to keep (the newest).
    #[arg(long, default_value_t = 3)]
    keep_checkpoints: usize,
    /// Continue a run from its newest checkpoint, with its recorded model,
    /// data and schedule; strategy and world size may differ.
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Start from these weights (a run directory or a Hugging Face GPT-2 folder):
    /// its model shape and tokenizer replace --model and --tokenizer.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Stop (with a checkpoint) after this many steps of this invocation.
    #[arg(long)]
    stop_after: Option<usize>,
    /// Testing aid: make this rank fail (with --fail-step).
    #[arg(long, requires = "fail_step")]
    fail_rank: Option<usize>,
    /// Testing aid: the step (0-based) at which --fail-rank fails.
    #[arg(long, requires = "fail_rank")]
    fail_step: Option<usize>,
}

#[derive(Args)]
struct GenerateArgs {
    /// A run directory written by `distgpt train` (model.safetensors + model.json).
    #[arg(long)]
    run: PathBuf,
    /// Text to continue; repeat for a batch of prompts (default: a newline, or <|endoftext|> for GPT-2 tokens).
    #[arg(long)]
    prompt: Vec<String>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 500)]
    tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sample among the most likely tokens whose probabilities sum to p (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Tensor-parallel ranks to split the model over (heads and MLP columns):
    /// threads here, or with --comm mpi every process mpirun starts.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// local: tp ranks are threads of this process; mpi: processes started by mpirun.
    #[arg(long, value_enum, default_value = "local")]
    comm: CommKind,
    /// Weight storage while decoding.
    #[arg(long, value_enum, default_value = "f32")]
    weights: DecodeWeightsArg,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Gather a (sharded) checkpoint into one plain safetensors file with Hugging Face GPT-2 names.
    Consolidate(ConsolidateArgs),
}

#[derive(Args)]
struct ConsolidateArgs {
    /// A run directory (its newest checkpoint) or one checkpoint directory.
    checkpoint: PathBuf,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct ExportArgs {
    /// A run directory (or any folder `generate` accepts).
    #[arg(long)]
    run: PathBuf,
    /// Output folder for `GPT2LMHeadModel.from_pretrained`.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct EvalArgs {
    /// A run directory or a Hugging Face GPT-2 folder.
    model: PathBuf,
    /// Data: a text file or a shard directory (default: the embedded corpus); its validation split is used.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Batches to evaluate (0: the whole split).
    #[arg(long, default_value_t = 50)]
    batches: usize,
}

#[derive(Args)]
struct PrepareArgs {
    /// A text file (default: the embedded Shakespeare corpus).
    #[arg(long)]
    input: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "char")]
    tokenizer: TokenizerKind,
    /// Output directory for the shards and tokenizer.json.
    #[arg(long)]
    out: PathBuf,
}

/// Parses the command line and runs the command.
pub fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(n) = cli.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    match cli.command {
        Command::Train(a) => run_train(*a),
        Command::Generate(a) => run_generate(a),
        Command::Data(DataCommand::Prepare(a)) => {
            let (n_train, n_val) = data::prepare(a.input.as_deref(), a.tokenizer, &a.out)?;
            println!(
                "wrote {} ({n_train} train tokens, {n_val} val tokens)",
                a.out.display()
            );
            Ok(())
        }
        Command::Bench(a) => bench::run(a),
        Command::Compare(a) => compare::run(*a, rayon::current_num_threads()),
        Command::Plan(a) => plan::run(*a, rayon::current_num_threads()),
        Command::Export(a) => {
            let (model, meta) = checkpoint::load_model(Cpu::new(), &a.run)?;
            checkpoint::hf::export(&model, &meta.tokenizer, &a.out)?;
            println!("wrote {} (config.json, model.safetensors)", a.out.display());
            Ok(())
        }
        Command::Eval(a) => run_eval(a),
        Command::Checkpoint(CheckpointCommand::Consolidate(a)) => {
            let dir = checkpoint::state::latest(&a.checkpoint)?;
            let state = checkpoint::state::load(&dir)?;
            let mut model = distgpt::model::Gpt2::new(Cpu::new(), state.index.model.clone())?;
            model.params.copy_from_slice(&state.params);
            checkpoint::save_weights(&model, &a.out)?;
            println!(
                "wrote {} from {} (step {}, saved by {} on {} rank(s))",
                a.out.display(),
                dir.display(),
                state.index.step,
                state.index.strategy,
                state.index.world_size
            );
            Ok(())
        }
    }
}

/// The model and training configuration of a new run, from the flags.
fn new_run(a: &TrainArgs, ds: &Dataset) -> Result<(GptConfig, TrainConfig)> {
    let model_cfg = a.model.resolve(Some(ds.tokenizer.vocab_size()))?;
    let out_dir = a.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from(format!("runs/{}-{secs}", a.model.model))
    });
    let cfg = TrainConfig {
        batch_size: a.batch_size,
        seq_len: a.seq_len.unwrap_or(model_cfg.block_size),
        grad_accum: a.grad_accum,
        duration: a.epochs.map_or(Duration::Steps(a.steps), Duration::Epochs),
        lr: a.lr,
        min_lr: a.min_lr.unwrap_or(a.lr / 10.0),
        warmup_steps: a.warmup,
        adamw: AdamWConfig {
            beta1: a.beta1,
            beta2: a.beta2,
            eps: 1e-8,
            weight_decay: a.weight_decay,
        },
        grad_clip: a.grad_clip,
        eval_every: a.eval_every,
        eval_batches: a.eval_batches,
        sample_every: a.sample_every,
        sample_tokens: a.sample_tokens,
        seed: a.seed,
        out_dir,
        peak_flops: a.peak_gflops.map(|g| g * 1e9),
        verbose: !a.quiet,
        fault: None,
        checkpoint_every: a.checkpoint_every,
        keep_checkpoints: a.keep_checkpoints,
        resume: None,
        stop_after: None,
        init_from: None,
        data: a.data.clone(),
        tokenizer: a.tokenizer,
        progress: None,
    };
    Ok((model_cfg, cfg))
}

/// The configuration recorded in a run directory, set to continue from its newest checkpoint.
fn resumed_run(run_dir: &std::path::Path) -> Result<(GptConfig, TrainConfig)> {
    let path = run_dir.join("run.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let j: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let model_cfg: GptConfig = serde_json::from_value(j["model"].clone())
        .with_context(|| format!("{}: model", path.display()))?;
    let mut cfg: TrainConfig = serde_json::from_value(j["train"].clone())
        .with_context(|| format!("{}: train", path.display()))?;
    cfg.resume = Some(checkpoint::state::latest(run_dir)?);
    cfg.out_dir = run_dir.to_path_buf();
    Ok((model_cfg, cfg))
}

fn run_train(a: TrainArgs) -> Result<()> {
    if let Some(p) = a.data.as_ref().filter(|p| !p.exists()) {
        bail!("data path {} does not exist", p.display());
    }
    let (ds, model_cfg, mut cfg) = match &a.resume {
        Some(run_dir) => {
            let (model_cfg, cfg) = resumed_run(run_dir)?;
            let ds = Dataset::load(cfg.data.as_deref(), cfg.tokenizer)?;
            eprintln!(
                "resuming {} from {}",
                run_dir.display(),
                cfg.resume
                    .as_ref()
                    .map_or(String::new(), |p| p.display().to_string())
            );
            (ds, model_cfg, cfg)
        }
        None => match &a.init_from {
            Some(dir) => {
                let meta = checkpoint::read_any_meta(dir)?;
                let ds = Dataset::load_for_model(a.data.as_deref(), &meta.tokenizer)?;
                let (_, mut cfg) = new_run(&a, &ds)?;
                cfg.seq_len = a.seq_len.unwrap_or(meta.config.block_size);
                cfg.init_from = Some(dir.clone());
                (ds, meta.config, cfg)
            }
            None => {
                let ds = Dataset::load(a.data.as_deref(), a.tokenizer)?;
                let (model_cfg, cfg) = new_run(&a, &ds)?;
                (ds, model_cfg, cfg)
            }
        },
    };
    cfg.verbose = !a.quiet;
    cfg.stop_after = a.stop_after;
    cfg.fault = a
        .fail_rank
        .zip(a.fail_step)
        .map(|(rank, step)| Fault { rank, step });
    // Ctrl-C: finish the step, checkpoint, stop (a second Ctrl-C kills as usual).
    let _ = ctrlc::set_handler(|| {
        if train::INTERRUPTED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\ninterrupted: finishing the step and writing a checkpoint (Ctrl-C again to abort)"
        );
    });
    let par = a.parallel.config();
    par.resolved().validate(&model_cfg, cfg.batch_size)?;
    let threads = rayon::current_num_threads();
    let Some(s) = a
        .parallel
        .launch(threads, |world| {
            train::train_rank(Cpu::new(), model_cfg.clone(), &ds, &cfg, par, world)
        })?
        .flatten()
    else {
        return Ok(());
    };
    println!("--- sample ---\n{}\n--------------", s.sample);
    println!(
        "{} steps in {:.1} s | loss {:.4} -> {:.4} | val loss {:.4} | {:.0} tokens/s, MFU {:.1}% (wall clock, evaluation included)",
        s.steps,
        s.seconds,
        s.first_loss,
        s.final_loss,
        s.val_loss,
        s.tokens_per_s,
        100.0 * s.mfu
    );
    println!("peak memory (rank 0): {}", metrics::memory_line(&s.memory));
    if s.rank_peak_bytes.len() > 1 {
        let h = metrics::human_bytes;
        for (r, p) in s.rank_peak_bytes.iter().enumerate() {
            println!(
                "rank {r}: peak {} (params {}, grads {}, optimizer {}, activations {}) | sent {} in {:.2} s of collectives",
                h(p[5]),
                h(p[0]),
                h(p[1]),
                h(p[2]),
                h(p[3]),
                h(s.rank_comm_bytes[r]),
                s.rank_comm_seconds[r]
            );
        }
    }
    println!(
        "run directory: {} (metrics.jsonl, model.safetensors, model.json)",
        s.out_dir.display()
    );
    Ok(())
}

fn run_eval(a: EvalArgs) -> Result<()> {
    let (mut model, meta) = checkpoint::load_model(Cpu::new(), &a.model)?;
    let ds = Dataset::load_for_model(a.data.as_deref(), &meta.tokenizer)?;
    let t = a.seq_len.unwrap_or(model.config.block_size);
    let mut val = distgpt::data::DataLoader::new(&ds.val, "val", a.batch_size, t, 0, false)?;
    let n = if a.batches == 0 {
        val.batches_per_epoch()
    } else {
        a.batches.min(val.batches_per_epoch())
    };
    let pb = metrics::progress_bar(n as u64, "eval");
    let mut sum = 0.0f64;
    for _ in 0..n {
        let batch = val.next_batch();
        sum += model
            .forward(&batch.inputs, Some(&batch.targets), a.batch_size, t)?
            .expect("targets given") as f64;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let loss = sum / n as f64;
    println!(
        "{}: val loss {loss:.4}, perplexity {:.2} ({n} batches of {} x {t} tokens from {})",
        a.model.display(),
        loss.exp(),
        a.batch_size,
        ds.name
    );
    Ok(())
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let meta = checkpoint::read_any_meta(&a.run)?;
    let tk = data::Tokenizer::from_spec(&meta.tokenizer)?;
    let prompts: Vec<Vec<u32>> = if a.prompt.is_empty() {
        vec![match tk.eot() {
            Some(eot) => vec![eot],
            None => tk.encode("\n")?,
        }]
    } else {
        a.prompt
            .iter()
            .map(|p| tk.encode(p))
            .collect::<distgpt::error::Result<_>>()?
    };
    let cfg = SampleConfig {
        max_new_tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    // One prompt streams: the prompt, then each token as it comes (printed by
    // the rank that samples, so once under mpirun too).
    let stream = prompts.len() == 1;
    let mut stdout = std::io::stdout();
    let mut shown_prompt = false;
    let mut show = |_: usize, tok: u32| {
        if stream {
            if !shown_prompt {
                let _ = write!(stdout, "{}", a.prompt.first().map_or("", String::as_str));
                shown_prompt = true;
            }
            let _ = write!(stdout, "{}", tk.decode(&[tok]));
            let _ = stdout.flush();
        }
    };
    let started = std::time::Instant::now();
    let (out, tp) = if a.tp <= 1 && a.comm == CommKind::Local {
        let (model, _) = checkpoint::load_model(Cpu::new(), &a.run)?;
        let place = distgpt::model::TpPlace { rank: 0, size: 1 };
        let weights = distgpt::infer::kv::DecodeWeights::new(
            model.backend(),
            &model.config,
            place,
            &model.params,
            a.weights.format(),
        )?;
        let out = generate_packed(&model, &weights, &prompts, &cfg, tk.eot(), &mut show)?;
        (out, 1)
    } else {
        let show = std::sync::Mutex::new(&mut show);
        let decode_rank = |comm: &dyn Comm| {
            if a.tp > 1 && a.tp != comm.size() {
                return Err(distgpt::error::Error::Input(format!(
                    "--tp {} but mpirun started {} ranks: generate splits the model over all of them",
                    a.tp,
                    comm.size()
                )));
            }
            let (model, _) = checkpoint::load_model(Cpu::new(), &a.run)?;
            let place = distgpt::model::TpPlace {
                rank: comm.rank(),
                size: comm.size(),
            };
            let engine =
                distgpt::model::Engine::new(Cpu::new(), meta.config.clone(), place, false)?;
            let mut local = vec![0.0; engine.layout.total()];
            distgpt::model::gpt2::shard_tp(
                &model.params,
                &model.layout,
                &engine.layout,
                place,
                &mut local,
            );
            let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
            let max_t = (longest + cfg.max_new_tokens).min(meta.config.block_size);
            let weights = distgpt::infer::kv::DecodeWeights::new(
                &Cpu::new(),
                &meta.config,
                place,
                &local,
                a.weights.format(),
            )?;
            let mut dec = distgpt::infer::kv::Decoder::new(
                Cpu::new(),
                meta.config.clone(),
                place,
                prompts.len(),
                max_t,
            )?;
            let lead = comm.rank() == 0;
            let out = distgpt::infer::generate::decode(
                &mut dec,
                &weights,
                &prompts,
                max_t,
                &cfg,
                tk.eot(),
                Some(comm),
                |r, t| {
                    if lead {
                        (show.lock().expect("printer"))(r, t)
                    }
                },
            )?;
            Ok((out, comm.size()))
        };
        let timeout = std::time::Duration::from_secs(120);
        match a.comm {
            CommKind::Local => {
                let threads = rayon::current_num_threads();
                let mut outs =
                    launch::run_local(a.tp, threads, timeout, |c| decode_rank(c.as_ref()))?;
                outs.swap_remove(0)
            }
            // Only rank 0 reports.
            CommKind::Mpi => match mpi_launch(timeout, decode_rank)? {
                Some(out) => out,
                None => return Ok(()),
            },
        }
    };
    let secs = started.elapsed().as_secs_f64();
    if stream && out[0].is_empty() {
        print!("{}", a.prompt.first().map_or("", String::as_str));
    }
    if !stream {
        for (p, o) in a.prompt.iter().zip(&out) {
            println!("--- {p:?} ---\n{p}{}", tk.decode(o));
        }
    }
    let n: usize = out.iter().map(Vec::len).sum();
    eprintln!(
        "\n[{n} tokens in {secs:.2} s: {:.1} tokens/s, {} prompt(s), tp {}, {} weights]",
        n as f64 / secs,
        prompts.len(),
        tp,
        a.weights.format().name()
    );
    Ok(())
}
