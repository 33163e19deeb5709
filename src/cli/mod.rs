//! Command-line interface: clap commands turned into library configs. This
//! file holds the command tree and the arguments several commands share
//! (model, layout, device); each command's own arguments and work live in
//! its file (`training`, `evaluate`, `generate`, `export`, `quantize`,
//! `prune`, `consolidate`, `bench`, `compare`, `plan`, `plot`, `devices`,
//! `prepare`; `config` reads `train --config`, `help` leads each command's
//! help with its example).

mod bench;
mod compare;
mod compat;
mod config;
mod consolidate;
mod devices;
mod evaluate;
mod export;
mod generate;
mod help;
mod plan;
mod plot;
mod prepare;
mod prune;
mod quantize;
mod training;

use anyhow::{bail, Context, Result};
use clap::{Args, FromArgMatches, Parser, Subcommand};
use compat::{old_spelling, run_or_old_flag, OldPeakGflops};
use consolidate::{consolidate, run_consolidate, ConsolidateArgs};
use devices::DevicesArgs;
use distgpt::backend::cpu::Cpu;
use distgpt::backend::{Backend, DeviceKind, OnBackend, WeightFormat};
use distgpt::checkpoint;
use distgpt::comm::Comm;
use distgpt::data::{self, Dataset, TokenizerKind};
use distgpt::metrics;
use distgpt::model::bert::BertConfig;
use distgpt::model::family::{Generation, Reshape};
use distgpt::model::files;
use distgpt::model::{AdamWConfig, ModelConfig};
use distgpt::parallel::launch::{self, CommKind, Launch};
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::sample::SampleConfig;
use distgpt::train::{self, Duration, Fault, FaultKind, TaskData, TaskKind, TrainConfig};
use evaluate::{run_eval, EvalArgs};
use export::{run_export, ExportArgs};
use generate::{run_generate, GenerateArgs};
use plot::PlotArgs;
use prepare::DataCommand;
use prune::{run_prune, PruneArgs};
use quantize::{run_quantize, QuantizeArgs};
use std::io::Write;
use std::path::{Path, PathBuf};
use training::{run_train, TrainArgs};

/// How a command ended, for the exit status.
pub enum Outcome {
    Done,
    /// A run stopped before its end (a signal or --stop-after), with a checkpoint.
    Stopped,
}

/// Exit status of a stopped run: EX_TEMPFAIL, "try again later" (resume it).
pub const STOPPED_EXIT_CODE: u8 = 75;
/// The most worker threads `--threads` takes (each is an OS thread with its stack).
const MAX_THREADS: usize = 1024;

#[derive(Parser)]
#[command(name = "distgpt", version, about = "Train GPT-2-family language models and BERT encoders, and compare parallel strategies", long_about = None)]
pub struct Cli {
    /// Worker threads (default: every core), shared among thread ranks,
    /// at least one each.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no arguments: a Shakespeare character model on the embedded corpus).
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Train(Box<TrainArgs>),
    /// Sample text from a trained run directory.
    // negative numbers are values, refused by their ranges
    // RUN is required (clap shows it optional: the hidden `--run` may give it)
    #[command(
        allow_negative_numbers = true,
        override_usage = "distgpt generate [OPTIONS] <RUN>"
    )]
    Generate(GenerateArgs),
    /// Prepare data.
    #[command(subcommand)]
    Data(DataCommand),
    /// Measure training throughput, MFU and peak memory on synthetic tokens.
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Bench(bench::BenchArgs),
    /// Train a matrix of strategies x world sizes x batch sizes and write a
    /// report: results.json/.csv, report.md and PNG/SVG figures.
    Compare(Box<compare::CompareArgs>),
    /// Predict per-rank memory and step time of every strategy for a model,
    /// world size, device and network, and recommend the fastest that fits.
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Plan(Box<plan::PlanArgs>),
    /// Write a run's model as a Hugging Face folder (config.json, model.safetensors and the tokenizer's files).
    // negative numbers are values, refused by their ranges
    #[command(
        allow_negative_numbers = true,
        override_usage = "distgpt export [OPTIONS] --out <OUT> <RUN>"
    )]
    Export(ExportArgs),
    /// Write a run's model with the blocks' weight matrices in int8 (per
    /// output column, fp32 scales): a model folder that generate, eval and
    /// export read (decode it with --weights int8).
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Quantize(QuantizeArgs),
    /// Pruning of the blocks in an iterative schedule (prune, fine-tune,
    /// evaluate; next level): single weights by magnitude (held at zero
    /// while fine-tuning) or whole heads and MLP units (the model shrinks);
    /// the last level's model and a report of validation loss (and, timed,
    /// step and token time) vs sparsity (table and figures).
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Prune(PruneArgs),
    /// Validation loss and perplexity of a model (a run directory or a Hugging Face folder).
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Eval(EvalArgs),
    /// Training-state checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Draw the loss, validation loss, gradient norm and throughput curves
    /// of one or several runs (PNG and SVG).
    Plot(PlotArgs),
    /// List the devices `--device` can use (OpenCL, and NVIDIA GPUs in a
    /// build with `--features cuda`), with the peak FLOP/s MFU is stated against.
    Devices(DevicesArgs),
}

/// Model shape: a preset, with any field overridden.
#[derive(Args, Clone)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// Model preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, shakespeare-char, shakespeare-char-small, tiny;
    /// BERT's for `train --task mlm|pretrain|classify`, `bench` and `plan`: bert-minilm, bert-minilm-mlm, bert-base,
    /// bert-base-mlm, bert-base-pretrain, bert-tiny; or a GPT-2 model folder (a run, a checkpoint, `prune`'s output) for its
    /// shape, per-block widths included.
    #[arg(long, default_value = "shakespeare-char-small")]
    model: String,
    /// Transformer blocks (overrides the preset's).
    #[arg(long, value_parser = non_negative())]
    n_layer: Option<usize>,
    /// Attention heads per block (must divide --n-embd).
    #[arg(long, value_parser = non_negative())]
    n_head: Option<usize>,
    /// Width of the residual stream (embedding size).
    #[arg(long, value_parser = non_negative())]
    n_embd: Option<usize>,
    /// Maximum sequence length (positions).
    #[arg(long, value_parser = non_negative())]
    block_size: Option<usize>,
}

impl ModelArgs {
    pub fn model_name(&self) -> &str {
        &self.model
    }

    /// A GPT-2 or BERT preset with overrides and the given vocabulary, validated.
    pub fn resolve_family(&self, vocab_size: Option<usize>) -> Result<ModelConfig> {
        let c = self.family_shape(vocab_size)?;
        c.validate()?;
        Ok(c)
    }

    /// [`ModelArgs::resolve_family`] with the shape validated but not the
    /// size: `plan` prices models far past what this machine would
    /// allocate, and allocates none of them. A preset of any family, or
    /// the model of a folder (model files, a Hugging Face folder or a
    /// checkpoint), which the shape flags do not change.
    pub fn family_shape(&self, vocab_size: Option<usize>) -> Result<ModelConfig> {
        let folder = Path::new(&self.model);
        let given = [self.n_layer, self.n_head, self.n_embd, self.block_size];
        let base = match folder.is_dir() {
            true if given.iter().any(Option::is_some) => bail!(
                "--n-layer, --n-head, --n-embd and --block-size change a preset, not the model read from {}",
                folder.display()
            ),
            true => checkpoint::read_any_meta(folder)?.config,
            false => ModelConfig::preset(&self.model)?,
        };
        let changes = Reshape {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            block_size: self.block_size,
            vocab_size,
        };
        Ok(base.reshaped(&changes)?)
    }
}

/// How ranks are arranged and started.
#[derive(Args, Clone)]
#[command(next_help_heading = "Parallelism")]
pub struct ParallelArgs {
    /// Parallel strategy.
    #[arg(long, value_enum, default_value = "single")]
    strategy: StrategyKind,
    /// Number of ranks (threads with --comm local; must equal mpirun's -np with --comm mpi).
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    /// Tensor-parallel group size (strategy tp: default the whole world; ddp with --tp: a dp x tp mesh).
    #[arg(long, value_parser = positive(), default_value_t = 1)]
    tp: usize,
    /// Pipeline stages: the blocks split into this many contiguous stages
    /// (balanced by their matmul work), a rank each; with ddp, --world-size
    /// is dp x pp x tp.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Pipeline schedule over the micro-batches (--grad-accum of them):
    /// 1f1b keeps at most pp micro-batches' activations on a stage, gpipe all.
    #[arg(long, value_enum, default_value = "1f1b")]
    schedule: distgpt::parallel::Schedule,
    /// Chunks of blocks per rank under --schedule interleaved (default 2):
    /// chunk c of rank s is stage c x pp + s of pp x this many.
    #[arg(long)]
    virtual_stages: Option<usize>,
    /// Recompute each block's activations in the backward instead of
    /// keeping them (and GPT-2's logits past 256 MiB, in chunks of rows).
    #[arg(long)]
    recompute: bool,
    /// The matmuls' arithmetic: fp32, or bf16 operands with fp32
    /// accumulation (fp32 master weights, moments and gradient reduction).
    #[arg(long, value_enum, default_value = "fp32")]
    precision: distgpt::model::Precision,
    /// With --device opencl or cuda, what of each rank's training state
    /// lives in host memory (ZeRO-Offload): `optimizer`, the AdamW moments
    /// and an fp32 master copy of the parameters the rank updates (AdamW
    /// runs on the CPU); `params`, with fsdp, the parameter shards too.
    #[arg(long, value_enum, default_value = "none")]
    offload: distgpt::parallel::Offload,
    /// With --offload: copy the gradient down, update, and copy the
    /// parameters up one after another, after the backward, instead of
    /// overlapped (the gradient started down during the backward, then
    /// chunk by chunk; to measure what the overlap buys).
    #[arg(long)]
    offload_serial: bool,
    /// How the ranks run.
    #[arg(long, value_enum, default_value = "local")]
    comm: CommKind,
    /// Seconds a collective may wait for the other ranks before failing.
    #[arg(long, default_value_t = 120.0)]
    comm_timeout: f64,
}

/// Where the kernels run.
#[derive(Args, Clone)]
#[command(next_help_heading = "Device")]
pub struct DeviceArgs {
    /// cpu: this machine's cores; opencl: an OpenCL device (a GPU, or PoCL
    /// on the CPU, where it is slow but exercises every device kernel);
    /// cuda: an NVIDIA GPU (needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// With --device opencl: which device, counted across platforms as
    /// `distgpt devices` lists them.
    #[arg(long, default_value_t = 0)]
    opencl_device: usize,
    /// With --device cuda: which GPU, as `distgpt devices` lists them.
    /// Under mpirun each process adds its local rank (Open MPI, MPICH or
    /// Slurm), wrapping around the GPUs there are.
    #[arg(long, default_value_t = 0)]
    cuda_device: usize,
}

impl DeviceArgs {
    /// The CPU backend (its thread ranks share this process's threads).
    pub(super) fn is_cpu(&self) -> bool {
        self.device == DeviceKind::Cpu
    }

    /// `op` run on the backend `--device` chooses (a cuda device under
    /// mpirun offset by the process's local rank).
    pub(super) fn run<R, O: OnBackend<Out = Result<R>>>(&self, op: O) -> Result<R> {
        let ordinals = [
            ("--opencl-device", self.opencl_device, DeviceKind::Opencl),
            ("--cuda-device", self.cuda_device, DeviceKind::Cuda),
        ];
        for (flag, n, kind) in ordinals {
            if n != 0 && kind != self.device {
                bail!(
                    "{flag} {n} picks a device of --device {}, but --device is {}: pass --device {0}, or leave {flag} out",
                    config::name(kind),
                    config::name(self.device)
                );
            }
        }
        let index = match self.device {
            DeviceKind::Cpu => 0,
            DeviceKind::Opencl => self.opencl_device,
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => distgpt::parallel::launch::rank_gpu(self.cuda_device)?,
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda => self.cuda_device,
        };
        distgpt::backend::on(self.device, index, op)?
    }

    /// The first GPU with --device cuda.
    fn cuda(&self) -> Option<usize> {
        (self.device == DeviceKind::Cuda).then_some(self.cuda_device)
    }
}

impl ParallelArgs {
    fn config(&self) -> ParallelConfig {
        ParallelConfig {
            strategy: self.strategy,
            world_size: self.world_size,
            tp: self.tp,
            recompute: self.recompute,
            precision: self.precision,
            pipeline: distgpt::parallel::Pipeline {
                stages: self.pp,
                schedule: self.schedule,
                virtual_stages: self.virtual_stages.unwrap_or(match self.schedule {
                    distgpt::parallel::Schedule::Interleaved => 2,
                    _ => 1,
                }),
            },
            offload: self.offload,
            offload_serial: self.offload_serial,
        }
    }

    fn timeout(&self) -> Result<std::time::Duration> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            bail!("--comm-timeout must be a positive number of seconds");
        }
        std::time::Duration::try_from_secs_f64(self.comm_timeout).map_err(|_| {
            anyhow::anyhow!(
                "--comm-timeout {:e} seconds is more than a duration can hold",
                self.comm_timeout
            )
        })
    }

    /// Where and how the ranks start (on `device`'s GPU with --comm nccl).
    fn launch(&self, device: &DeviceArgs) -> Result<Launch> {
        Ok(Launch {
            comm: self.comm,
            world_size: self.world_size,
            timeout: self.timeout()?,
            cuda_device: device.cuda(),
        })
    }
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Gather a (sharded) checkpoint into a model directory (model.safetensors
    /// with Hugging Face GPT-2 names, and model.json) that eval, generate and export read.
    Consolidate(ConsolidateArgs),
}

/// Parses the command line and runs the command.
pub fn run() -> Result<Outcome> {
    let mut matches = help::command().get_matches();
    if let Some(train) = matches.subcommand_matches("train") {
        if let Some(file) = train.get_one::<PathBuf>("config").cloned() {
            matches = config::with_config_file(&file, &config::given_flags(train))?;
        }
    }
    let cli = Cli::from_arg_matches(&matches)?;
    if let Some(n) = cli.threads {
        if n == 0 || n > MAX_THREADS {
            bail!("--threads {n} must be between 1 and {MAX_THREADS}");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    // a library pinned by name must open here, or nothing runs
    distgpt::backend::cpu::blas::pinned()?;
    let done = |r: Result<()>| r.map(|()| Outcome::Done);
    // train, bench and generate take mpirun's processes as ranks; devices
    // says what each machine has
    let comm = match &cli.command {
        Command::Train(a) => Some(a.parallel.comm),
        Command::Bench(a) => Some(a.parallel.comm),
        Command::Generate(a) => Some(a.comm),
        _ => None,
    };
    if !matches!(cli.command, Command::Devices(_)) {
        launch::refuse_copies(matches.subcommand_name().unwrap_or_default(), comm)?;
    }
    // the flags given to train or eval on the command line (or --config)
    let given = matches
        .subcommand()
        .map(|(_, m)| config::given_flags(m))
        .unwrap_or_default();
    match cli.command {
        Command::Train(a) => run_train(*a, &given, cli.threads),
        Command::Generate(a) => done(run_generate(a)),
        Command::Data(c) => done(prepare::run(c)),
        Command::Bench(a) => done(bench::run(a)),
        Command::Compare(a) => done(compare::run(*a, rayon::current_num_threads())),
        Command::Plan(a) => done(plan::run(*a, rayon::current_num_threads())),
        Command::Export(a) => done(run_export(a)),
        Command::Eval(a) => done(run_eval(a, &given)),
        Command::Quantize(a) => done(run_quantize(a)),
        Command::Prune(a) => done(run_prune(a)),
        Command::Devices(a) => done(devices::run(a)),
        Command::Plot(a) => done(plot::run(a)),
        Command::Checkpoint(CheckpointCommand::Consolidate(a)) => done(run_consolidate(a)),
    }
}

/// Refuses an output (`flag`) that is a regular file, where the output is `what`.
fn refuse_file_out(out: &Path, flag: &str, what: &str) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("{flag} {} is a file: the output is {what}", out.display());
    }
    Ok(())
}

/// Refuses an output folder that is a file, or that is the input or holds
/// anything (another command's results would be replaced or mixed with
/// the new ones) unless `overwrite`.
fn refuse_output_over_input(input: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let same = match (input.canonicalize(), out.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same && !overwrite && out.is_dir() {
        bail!(
            "--out {} is the input: its model files would be replaced; choose another --out, or pass --overwrite",
            out.display()
        );
    }
    claim_out(out, "--out", "a model folder", overwrite)
}

/// Refuses an output folder (given as `flag`, holding `what`) that is a
/// file or already holds files, unless `overwrite`: one command's results
/// never silently replace or mix with another's.
fn claim_out(out: &Path, flag: &str, what: &str, overwrite: bool) -> Result<()> {
    refuse_file_out(out, flag, what)?;
    if overwrite {
        return Ok(());
    }
    let mut held: Vec<String> = match std::fs::read_dir(out) {
        Ok(d) => d
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    held.sort();
    if let Some(first) = held.first() {
        let what = match train::run_dir::holds_a_run(out) {
            true => "a training run".to_string(),
            false => format!(
                "{} ({first}{})",
                metrics::count(held.len(), "item"),
                if held.len() > 1 { ", ..." } else { "" }
            ),
        };
        bail!(
            "{flag} {} already holds {what}: another command's results would be replaced or mixed with these; choose another {flag}, or pass --overwrite",
            out.display()
        );
    }
    Ok(())
}

/// The parser of a count that must be at least 1 (batch sizes, sequence
/// lengths, steps, tokens, ranks): one rule for every command that takes one.
pub(crate) fn positive() -> impl clap::builder::TypedValueParser<Value = usize> {
    count(1, 1 << 40)
}

/// A count from 0, for flags where 0 means none or all (or is refused
/// later, in words of its own).
pub(crate) fn non_negative() -> impl clap::builder::TypedValueParser<Value = usize> {
    count(0, 1 << 40)
}

/// A count from `min` to `max`, read as a signed number so that a negative one
/// is refused by its range rather than misread as a flag.
pub(crate) fn count(min: i64, max: i64) -> impl clap::builder::TypedValueParser<Value = usize> {
    use clap::builder::TypedValueParser;
    clap::builder::RangedI64ValueParser::<i64>::new()
        .range(min..=max)
        .map(|v| v as usize)
}

/// The parser of `--grad-accum`: 1 to [`distgpt::train::MAX_GRAD_ACCUM`]
/// micro-batches a step.
pub(crate) fn micro_batches() -> impl clap::builder::TypedValueParser<Value = usize> {
    count(1, distgpt::train::MAX_GRAD_ACCUM as i64)
}

/// The parser of a `--seed`: a whole number from 0 to `u64::MAX`, read
/// as given (with `allow_negative_numbers` on the flag) so that a negative
/// or overflowing one is refused by its range, as a count is.
pub(crate) fn seed(s: &str) -> std::result::Result<u64, String> {
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s} is not a whole number"));
    }
    match s.parse::<u64>() {
        Ok(v) => Ok(v),
        Err(_) => Err(format!("{s} is not in 0..={}", u64::MAX)),
    }
}

/// The parser of `plan`'s peak, memory and bandwidths: a positive finite
/// number, which can be divided by.
pub(crate) fn positive_rate(s: &str) -> std::result::Result<f64, String> {
    finite_number(s, false)
}

/// The parser of `--peak-tflops` on train and bench: a positive number
/// that is one FLOP/s or more and finite once in FLOP/s (1e300 was an
/// infinite peak, and every MFU 0).
pub(crate) fn peak_tflops(s: &str) -> std::result::Result<f64, String> {
    peak(s, 1e12, "TFLOP/s")
}

/// A peak given in `unit`s of `scale` FLOP/s.
fn peak(s: &str, scale: f64, unit: &str) -> std::result::Result<f64, String> {
    let v = finite_number(s, false)?;
    match (v * scale).is_finite() && v * scale >= 1.0 {
        true => Ok(v),
        false => Err(format!(
            "{s} {unit} is {:e} FLOP/s: a peak is 1 to {:e}",
            v * scale,
            f64::MAX
        )),
    }
}

/// The parser of a latency: a finite number, 0 or more.
pub(crate) fn non_negative_rate(s: &str) -> std::result::Result<f64, String> {
    finite_number(s, true)
}

/// A finite number above 0, or from 0 with `zero`.
fn finite_number(s: &str, zero: bool) -> std::result::Result<f64, String> {
    let v = s.parse::<f64>().map_err(|e| format!("{s}: {e}"))?;
    match v.is_finite() && (v > 0.0 || (zero && v == 0.0)) {
        true => Ok(v),
        false if zero => Err(format!("{s} is not a number 0 or more")),
        false => Err(format!("{s} is not a positive number")),
    }
}
