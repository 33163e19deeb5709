//! `distgpt bench`: training throughput, MFU, peak memory per rank by
//! category and communication volume and time, on synthetic tokens, for any
//! strategy and world size, in the shape `bench/pytorch_reference.py` mirrors.

use super::{micro_batches, positive};
use super::{CommKind, DeviceArgs, ModelArgs, ParallelArgs, WeightFormat};
use anyhow::Result;
use clap::Args;
use distgpt::backend::cpu::hardware::HardwarePeak;
use distgpt::backend::{profile, Backend, OnBackend};
use distgpt::metrics::{self, peak};
use distgpt::model::{ModelConfig, Precision};
use distgpt::parallel::{launch, ParallelConfig};
use distgpt::train::bench::{bench_rank, BenchSpec};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    pub(super) parallel: ParallelArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Vocabulary size (default: the preset's; 65 for the char presets).
    #[arg(long, help_heading = "Benchmark")]
    vocab_size: Option<usize>,
    /// Global batch: sequences per micro-step, split across the data-parallel ranks.
    #[arg(long, value_parser = positive(), default_value_t = 16, help_heading = "Benchmark")]
    batch_size: usize,
    /// Micro-steps per optimizer step (a pipeline's micro-batches).
    #[arg(long, value_parser = micro_batches(), default_value_t = 1, help_heading = "Benchmark")]
    grad_accum: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, value_parser = positive(), help_heading = "Benchmark")]
    seq_len: Option<usize>,
    /// Timed optimizer steps.
    #[arg(long, value_parser = positive(), default_value_t = 10, help_heading = "Benchmark")]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2, help_heading = "Benchmark")]
    warmup: usize,
    /// Peak TFLOP/s of the device MFU is stated against, as `distgpt
    /// devices` prints it: this CPU's (its thread ranks share it; under
    /// mpirun a process's) or one GPU's (a rank each) (default: measured
    /// once per device and thread count, kept in ~/.cache/distgpt/peak.json).
    #[arg(long, value_parser = super::peak_tflops, help_heading = "Benchmark")]
    peak_tflops: Option<f64>,
    #[command(flatten)]
    old_peak: super::OldPeakGflops,
    /// Print one JSON object instead of text.
    #[arg(long, help_heading = "Benchmark")]
    json: bool,
    /// Measure KV-cache generation of this many tokens per row instead of
    /// training (rows = --batch-size, --prompt-tokens prompts, greedy; one rank).
    #[arg(long, help_heading = "Benchmark")]
    generate: Option<usize>,
    /// With --generate: each row's prompt in tokens, fed in one pass before
    /// the first new token (timed apart: the time to the first token).
    #[arg(
        long,
        default_value_t = 1,
        value_name = "N",
        help_heading = "Benchmark"
    )]
    prompt_tokens: usize,
    /// Weight storage for --generate.
    #[arg(long, value_enum, default_value = "f32", help_heading = "Benchmark")]
    weights: WeightFormat,
    /// Time every kernel over the timed steps and print each one's share of
    /// the step, its calls and its GFLOP/s (a GPU finishes its queue around
    /// each kernel meanwhile, so its steps run slower than unprofiled ones).
    #[arg(long, help_heading = "Benchmark")]
    profile: bool,
    /// With --pp: draw the last timed step's pipeline timeline (every
    /// rank's forwards, backwards and idle time) as timeline.png and .svg in DIR.
    #[arg(long, value_name = "DIR", help_heading = "Benchmark")]
    timeline: Option<std::path::PathBuf>,
}

/// The fastest of the generation `runs` (seconds, seconds to the first
/// new token, new tokens) after the first `warmup`, which are untimed as
/// training's warm-up steps are.
fn fastest_timed(runs: &[(f64, f64, usize)], warmup: usize, tokens: usize) -> (f64, f64, usize) {
    let timed = runs.iter().skip(warmup).copied();
    timed.fold(
        (f64::INFINITY, 0.0, tokens),
        |b, r| if r.0 < b.0 { r } else { b },
    )
}

/// Tokens/s of greedy KV-cache generation from a randomly initialised
/// model of any family with a decoder; the weights are packed for decoding
/// once, timed apart (like loading).
fn run_generate<B: Backend>(be: B, a: &BenchArgs, cfg: &ModelConfig, tokens: usize) -> Result<()> {
    let (prompt, block) = (a.prompt_tokens, cfg.block_size());
    if prompt == 0 || prompt > block {
        anyhow::bail!(
            "--prompt-tokens {prompt}: a prompt needs 1 to {block} tokens in a block of {block}"
        );
    }
    // the last new token is sampled from a full block, never fed
    if tokens == 0 || tokens > block - prompt + 1 {
        anyhow::bail!(
            "--generate {tokens}: a {prompt}-token prompt leaves room for 1 to {} new tokens in a block of {block}",
            block - prompt + 1
        );
    }
    // the KV cache alone, a bound from below: a batch it cannot hold is
    // refused here, not by the allocator's abort; it lives on the device
    // (a GPU's free memory where its driver says, the host's for the CPU,
    // unknown for an OpenCL device)
    let cache = (a.batch_size as f64)
        * (cfg.n_layer() * 2 * (prompt + tokens - 1) * cfg.n_embd() * size_of::<f32>()) as f64;
    let free = match (be.device_memory(), be.allocations()) {
        (Some((free, _)), _) => Some(free),
        (None, None) => metrics::available_memory_bytes(),
        (None, Some(_)) => None,
    };
    // mutant-equivalent: src/cli/bench.rs: replace > with >= in run_generate
    // (here: a cache of exactly the free bytes; the same name's mutant of
    // the room check above is caught, by --generate 65 after a 1-token
    // prompt in a 64-token block)
    if let Some(free) = free {
        if cache > free as f64 {
            anyhow::bail!(
                "--batch-size {}: its KV cache needs at least {}, but {} is available",
                a.batch_size,
                metrics::human_bytes(cache as u64),
                metrics::human_bytes(free)
            );
        }
    }
    let params = cfg.init_full(1);
    let vocab = cfg.vocab_size();
    let prompts: Vec<Vec<u32>> = (0..a.batch_size)
        .map(|r| (0..prompt).map(|i| ((r + 7 * i) % vocab) as u32).collect())
        .collect();
    let format = a.weights;
    let run = distgpt::model::family::TimedGeneration {
        params: &params,
        format,
        prompts: &prompts,
        new_tokens: tokens,
        runs: a.warmup + a.steps.max(1),
    };
    let timing = cfg.decoder("bench --generate")?.time(be, run)?;
    let (best, first, made) = fastest_timed(&timing.runs, a.warmup, tokens);
    if made != tokens {
        anyhow::bail!("a row made {made} of its {tokens} new tokens: the decoder stopped early");
    }
    let pack_s = timing.pack_seconds;
    let tokens_per_s = (a.batch_size * tokens) as f64 / best;
    if a.json {
        let j = serde_json::json!({"impl": "distgpt", "model": a.model.model_name(), "batch": a.batch_size, "new_tokens": tokens,
            "prompt_tokens": prompt, "threads": rayon::current_num_threads(), "weights": format.name(), "seconds": best,
            "first_token_seconds": first, "tokens_per_s": tokens_per_s, "pack_seconds": pack_s});
        distgpt::outln!("{j}");
    } else {
        distgpt::outln!(
            "distgpt {} generate: batch {} x {tokens} new tokens after {prompt}-token prompts (KV cache, greedy, {} weights), {} threads: {best:.3} s, {tokens_per_s:.1} tokens/s, the first after {first:.3} s (weights packed once in {pack_s:.3} s)",
            a.model.model_name(),
            a.batch_size,
            format.name(),
            rayon::current_num_threads()
        );
    }
    Ok(())
}

pub fn run(a: BenchArgs) -> Result<()> {
    let cfg = a.model.resolve_family(a.vocab_size)?;
    if a.warmup.checked_add(a.steps).is_none() {
        anyhow::bail!(
            "--warmup {} and --steps {} add up past any count of steps",
            a.warmup,
            a.steps
        );
    }
    if a.generate.is_none() && a.prompt_tokens != 1 {
        anyhow::bail!("--prompt-tokens sets --generate's prompts: give --generate N with it");
    }
    if a.generate.is_none() && a.weights != WeightFormat::F32 {
        anyhow::bail!(
            "--weights {} stores the weights --generate decodes with (training keeps fp32): give --generate N with it",
            a.weights.name()
        );
    }
    if a.generate.is_some() {
        if a.profile {
            anyhow::bail!("--profile times the kernels of training steps: leave out --generate");
        }
        let p = &a.parallel;
        if p.strategy != distgpt::parallel::StrategyKind::Single
            || p.world_size != 1
            || p.tp != 1
            || p.pp != 1
        {
            anyhow::bail!(
                "--generate times one rank's decoding: it takes no --strategy, --world-size, --tp or --pp (`distgpt generate --tp N` decodes tensor-parallel)"
            );
        }
        // the flags of training steps, which it runs none of (they were
        // taken and ignored)
        let training = [
            ("--seq-len", a.seq_len.is_some()),
            ("--grad-accum", a.grad_accum != 1),
            ("--precision", p.precision != Precision::Fp32),
            ("--recompute", p.recompute),
            ("--offload", p.offload != distgpt::parallel::Offload::None),
            ("--offload-serial", p.offload_serial),
            ("--virtual-stages", p.virtual_stages.is_some()),
            ("--timeline", a.timeline.is_some()),
        ];
        let given: Vec<&str> = (training.iter().filter(|(_, given)| *given))
            .map(|(flag, _)| *flag)
            .collect();
        if !given.is_empty() {
            anyhow::bail!(
                "{} set training steps, which --generate runs none of: its rows are --batch-size, its prompts --prompt-tokens, its weights' storage --weights",
                given.join(", ")
            );
        }
    }
    a.device.run(Bench(&a, &cfg))
}

/// `bench` on a backend: [`run_generate`] with --generate, else [`bench_on`].
struct Bench<'a>(&'a BenchArgs, &'a ModelConfig);

impl OnBackend for Bench<'_> {
    type Out = Result<()>;
    fn run<B: Backend>(self, be: B) -> Result<()> {
        let Bench(a, cfg) = self;
        match a.generate {
            Some(tokens) => run_generate(be, a, cfg, tokens),
            None => bench_on(be, a, cfg),
        }
    }
}

/// A sign of life before minutes of work, from the lead process (on
/// stderr: `--json`'s stdout is one line).
fn announce(a: &BenchArgs, cfg: &ModelConfig, par: &ParallelConfig, b: usize, t: usize) {
    if distgpt::train::run_dir::lead_process() {
        distgpt::errln!(
            "bench: {} {cfg}, batch {b} x {t}, {} x{}: {} warm-up and {} timed steps",
            a.model.model_name(),
            par.strategy,
            par.world_size,
            a.warmup,
            a.steps
        );
    }
}

/// The peaks a bench's MFU is measured against, each times the processes
/// (a rank's share of the machine under mpirun).
struct Peaks {
    /// `--peak-tflops`, where given.
    stated: Option<f64>,
    /// The matmul probe's peak (or the stated one) and where it came from.
    matmul: f64,
    matmul_source: String,
    /// The hardware's peak where it is known, with its description.
    hardware: Option<(f64, HardwarePeak)>,
    /// The peak the MFU stated is against, and where it came from.
    mfu: f64,
    mfu_source: String,
}

impl Peaks {
    /// `--peak-tflops` where given, else this machine's best matmul
    /// (measured, or kept from a measurement), and the hardware's where it
    /// is known. Stated or not, the kept peak names the hardware's and the
    /// CPU's matmul library (and its products run on that library from now
    /// on). One MFU is stated, as train states it: against the hardware's
    /// peak where it is known (or the stated one); the matmul probe is
    /// shown as what it is.
    fn of<B: Backend>(be: &B, stated: Option<f64>, bf16: bool, processes: f64) -> Self {
        let (here, matmul, matmul_source) = match stated {
            Some(p) => (
                peak::cached(be),
                every_process(p * 1e12, processes),
                "--peak-tflops".to_string(),
            ),
            None => {
                let h = peak::of(be, false);
                let (flops, name) = h.matmul_peak(bf16);
                let source = format!("{name}; {}", h.source);
                (Some(h), every_process(flops, processes), source)
            }
        };
        let hardware = here
            .and_then(|h| h.hardware_peak(bf16))
            .map(|hw| (every_process(hw.flops, processes), hw));
        let (mfu, mfu_source) = match (&hardware, stated) {
            (Some((flops, hw)), None) => (
                *flops,
                format!(
                    "the hardware's: {}{}",
                    hw.describe(),
                    if processes > 1.0 { ", per process" } else { "" }
                ),
            ),
            _ => (matmul, matmul_source.clone()),
        };
        Peaks {
            stated,
            matmul,
            matmul_source,
            hardware,
            mfu,
            mfu_source,
        }
    }
}

/// A process's peak, measured with its own threads, times the `processes`
/// that share the machine under mpirun (1 for thread ranks): the world's.
fn every_process(flops: f64, processes: f64) -> f64 {
    // mutant-equivalent: src/cli/bench.rs: replace * with + in every_process
    // mutant-equivalent: src/cli/bench.rs: replace * with / in every_process
    // (`processes` is 1 in every test the mutation step runs, built without
    // the mpi feature; tests/cli.rs's
    // bench_under_mpirun_states_the_peaks_of_every_process, in CI's mpi
    // pass, catches both, planted by hand)
    flops * processes
}

/// The processes whose peaks a bench's are: the peaks are measured with
/// every thread of this process, the whole machine for thread ranks, one
/// rank's share under mpirun (hence the scaling; on CPUs, processes that
/// share them count them once).
fn processes(a: &BenchArgs, par: &ParallelConfig) -> f64 {
    // mutant-equivalent: src/cli/bench.rs: replace processes -> f64 with 1.0
    // mutant-equivalent: src/cli/bench.rs: replace match guard a.device.is_cpu() with true in processes
    // mutant-equivalent: src/cli/bench.rs: replace match guard a.device.is_cpu() with false in processes
    // (the three tell apart only --comm mpi, which the mutation step's build
    // without the mpi feature never starts: tests/cli.rs's
    // bench_under_mpirun_counts_shared_cpus_once, in CI's mpi pass, catches
    // the first and the last; the second only on a GPU under mpirun)
    match a.parallel.comm {
        // processes on CPUs count the CPUs they can use, once each
        CommKind::Mpi if a.device.is_cpu() => launch::cpu_process_shares(par.world_size),
        CommKind::Mpi | CommKind::Nccl => par.world_size as f64,
        CommKind::Local => 1.0,
    }
}

/// A batch past memory is refused in words, as train refuses it (it was
/// killed by the kernel's OOM killer).
fn check_memory(
    a: &BenchArgs,
    cfg: &ModelConfig,
    par: &ParallelConfig,
    batch: usize,
    seq_len: usize,
    threads: usize,
) -> Result<()> {
    let w = distgpt::plan::Workload {
        model: cfg.clone(),
        batch,
        seq_len,
        grad_accum: a.grad_accum,
        cpu_threads: a.device.is_cpu().then_some(threads),
    };
    super::training::check_memory(&w, par.resolved())
}

fn bench_on<B: Backend>(be: B, a: &BenchArgs, cfg: &ModelConfig) -> Result<()> {
    let (b, t) = (a.batch_size, a.seq_len.unwrap_or(cfg.block_size()));
    // the process before any model: what the counted categories add to
    let rss_start = metrics::rss_bytes();
    let par = a.parallel.config();
    par.resolved().validate(cfg, b)?;
    // thread ranks run on at least one thread each (--threads 1 --world-size 2:
    // two threads in all), and the peak is that of all of theirs, as train
    // states it (agree_on_peak)
    let threads = match a.parallel.comm {
        CommKind::Local => launch::ranks_threads(rayon::current_num_threads(), par.world_size),
        CommKind::Mpi | CommKind::Nccl => rayon::current_num_threads(),
    };
    if a.parallel.comm == CommKind::Local {
        check_memory(a, cfg, &par, b, t, threads)?;
    }
    announce(a, cfg, &par, b, t);
    let processes = processes(a, &par);
    let stated = a.old_peak.or_stated(a.peak_tflops);
    // on a device its peak is the run's, whatever the host's threads
    let probe_threads = match a.device.is_cpu() {
        true => threads,
        false => rayon::current_num_threads(),
    };
    let bf16 = par.precision == Precision::Bf16;
    let peaks = launch::with_threads(probe_threads, || Peaks::of(&be, stated, bf16, processes))?;
    let spec = BenchSpec {
        batch: b,
        grad_accum: a.grad_accum,
        seq_len: t,
        warmup: a.warmup,
        steps: a.steps,
        show: !a.json,
        profile: a.profile,
    };
    let Some(ranks) = a.parallel.launch(&a.device)?.run(|world| {
        bench_rank(
            distgpt::comm::backend_for(&be, world)?,
            cfg,
            par,
            spec,
            world,
        )
    })?
    else {
        return Ok(());
    };
    let step_s = ranks.iter().map(|r| r.step_s).fold(0.0, f64::max);
    let tokens_per_s = (b * t * spec.grad_accum) as f64 / step_s;
    let bubble = ranks[0].bubble;
    let timelines: Vec<Vec<distgpt::parallel::Span>> =
        ranks.iter().map(|r| r.timeline.clone()).collect();
    let formula = par.pipeline.expected_bubble(spec.grad_accum, &timelines);
    let kernels = a
        .profile
        .then(|| KernelShares::measured(a, par.world_size, spec.steps, processes, peaks.mfu));
    let m = Measured {
        a,
        cfg,
        par,
        spec,
        b,
        t,
        threads,
        rss_start,
        step_s,
        tokens_per_s,
        peaks,
        bubble,
        formula,
        ranks,
        kernels,
    };
    if let Some(dir) = &a.timeline {
        m.draw_timeline(dir)?;
    }
    match a.json {
        true => m.print_json(),
        false => m.print_text(),
    }
    Ok(())
}

/// A bench's figures, as `bench_on` measured them, to be reported.
struct Measured<'a> {
    a: &'a BenchArgs,
    cfg: &'a ModelConfig,
    par: ParallelConfig,
    spec: BenchSpec,
    b: usize,
    t: usize,
    threads: usize,
    /// The process's RSS before any model.
    rss_start: Option<u64>,
    step_s: f64,
    tokens_per_s: f64,
    peaks: Peaks,
    bubble: Option<f64>,
    /// The schedule's bubble by its formula.
    formula: f64,
    ranks: Vec<distgpt::train::bench::RankBench>,
    /// `--profile`: each kernel's share of the step.
    kernels: Option<KernelShares>,
}

/// `--profile`'s figures: each kernel's wall time in a step of this
/// process (its thread ranks', and a rank's batch parts', side by side),
/// and what is left outside the kernels.
struct KernelShares {
    rows: Vec<KernelRow>,
    step_s: f64,
}

struct KernelRow {
    name: &'static str,
    calls: f64,
    seconds: f64,
    /// Model FLOPs a second and their share of the peak, for the kernels
    /// MFU counts.
    rate: Option<(f64, f64)>,
}

impl KernelShares {
    /// This process's profile over the timed steps. Thread ranks (an NCCL
    /// group's among them) share the process's profile and the peak of all
    /// of them; a rank under mpirun has its own of each. A step of the
    /// profile is its window over the timed steps: the steps as the process
    /// ran them, with the barriers and batches between them (thread ranks'
    /// steps do not start together on a loaded machine).
    fn measured(a: &BenchArgs, world: usize, steps: usize, processes: f64, peak: f64) -> Self {
        // mutant-equivalent: src/cli/bench.rs: replace && with || in KernelShares::measured
        // mutant-equivalent: src/cli/bench.rs: replace != with == in KernelShares::measured
        // (both tell apart only --comm nccl without mpirun, which needs a GPU,
        // or a rank under mpirun, which the mutation step's build without the
        // mpi feature never starts: tests/cli.rs's
        // bench_profile_under_mpirun_counts_a_ranks_kernels_against_its_share_of_the_peak,
        // in CI's mpi pass, catches the second)
        let rank_processes = a.parallel.comm != CommKind::Local && launch::under_mpirun();
        let (ranks_here, profiled) = match rank_processes {
            true => (1, processes),
            false => (world, 1.0),
        };
        let totals = profile::PROCESS.snapshot();
        // mutant-equivalent: src/cli/bench.rs: replace / with * in KernelShares::measured
        // (here `profiled` is 1 in every test the mutation step runs, built
        // without the mpi feature: tests/cli.rs's
        // bench_profile_under_mpirun_counts_a_ranks_kernels_against_its_share_of_the_peak,
        // in CI's mpi pass, catches it; the same name's mutant of the
        // window's division is caught)
        let window_step = profile::PROCESS.window() / steps as f64;
        Self::of(&totals, steps, ranks_here, window_step, peak / profiled)
    }

    /// From the profile's totals over `steps` timed steps of the `ranks`
    /// this process holds, against a step of `step_s` (the profile's window
    /// a step) on the process's `peak` FLOP/s: each kernel's time and FLOPs
    /// a step, its calls a rank.
    fn of(totals: &[profile::OpTotal], steps: usize, ranks: usize, step_s: f64, peak: f64) -> Self {
        let rows = totals
            .iter()
            .map(|t| {
                let seconds = t.seconds / steps as f64;
                let flops = t.flops / steps as f64;
                KernelRow {
                    name: t.name,
                    calls: t.calls as f64 / (steps * ranks) as f64,
                    seconds,
                    rate: (flops > 0.0 && seconds > 0.0)
                        .then(|| (flops / seconds, flops / seconds / peak)),
                }
            })
            .collect();
        KernelShares { rows, step_s }
    }

    /// The step's time outside every kernel: communication, host work,
    /// waits.
    fn outside_s(&self) -> f64 {
        self.step_s - self.rows.iter().map(|r| r.seconds).sum::<f64>()
    }

    fn json(&self) -> serde_json::Value {
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                serde_json::json!({"kernel": r.name, "calls_per_step": r.calls, "ms_per_step": 1e3 * r.seconds,
                    "share": r.seconds / self.step_s, "gflops": r.rate.map(|x| x.0 / 1e9), "of_peak": r.rate.map(|x| x.1)})
            })
            .collect();
        serde_json::json!({"kernels": rows, "outside_ms_per_step": 1e3 * self.outside_s(),
            "outside_share": self.outside_s() / self.step_s})
    }

    fn print(&self) {
        distgpt::outln!(
            "kernels (--profile): wall time a step and its share, calls a rank and step, model GFLOP/s and their share of the peak:"
        );
        for r in &self.rows {
            let rate = r
                .rate
                .map(|(f, p)| format!(" {:>8.1} GFLOP/s {:>5.1}%", f / 1e9, 100.0 * p))
                .unwrap_or_default();
            distgpt::outln!(
                "  {:<22} {:>9.2} ms {:>5.1}% {:>7.1} calls{rate}",
                r.name,
                1e3 * r.seconds,
                100.0 * r.seconds / self.step_s,
                r.calls
            );
        }
        distgpt::outln!(
            "  {:<22} {:>9.2} ms {:>5.1}% (communication, host work, waits)",
            "outside kernels",
            1e3 * self.outside_s(),
            100.0 * self.outside_s() / self.step_s
        );
    }
}

impl Measured<'_> {
    /// The MFU against `flops`.
    fn mfu_of(&self, flops: f64) -> f64 {
        metrics::mfu(self.cfg.flops_per_token(self.t), self.tokens_per_s, flops)
    }

    /// The MFU stated: against `peaks.mfu`.
    fn mfu(&self) -> f64 {
        self.mfu_of(self.peaks.mfu)
    }

    /// `--timeline DIR`: the pipeline's schedule as every rank ran it.
    fn draw_timeline(&self, dir: &std::path::Path) -> Result<()> {
        let (par, Some(bubble)) = (self.par, self.bubble) else {
            anyhow::bail!("--timeline draws a pipeline's schedule: add --pp 2 or more");
        };
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("--timeline {}: {e}", dir.display()))?;
        let title = format!(
            "{} {} x{}, pp {} {}, {} micro-batches: bubble {:.1}% measured, {:.1}% by formula",
            self.a.model.model_name(),
            par.strategy,
            par.world_size,
            par.pipeline.stages,
            par.pipeline,
            self.spec.grad_accum,
            100.0 * bubble,
            100.0 * self.formula
        );
        let grid = distgpt::parallel::Grid::of(&par);
        let timelines = self.ranks.iter().map(|x| &x.timeline);
        let tl = distgpt::figure::Timeline::of_ranks("timeline".into(), title, &grid, timelines);
        for path in distgpt::figure::write_timeline(dir, &tl)? {
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    }

    /// `--json`: one line of every figure.
    fn print_json(&self) {
        let (cfg, par, peak) = (self.cfg, self.par, self.peaks.matmul);
        let mut j = serde_json::json!({
            "impl": "distgpt", "model": self.a.model.model_name(), "params": cfg.num_params(), "batch": self.b, "seq": self.t,
            "strategy": par.strategy, "world_size": par.world_size, "tp": par.resolved().tp, "pipeline": par.pipeline, "grad_accum": self.spec.grad_accum, "recompute": par.recompute, "precision": par.precision,
            "offload": par.offload, "offload_serial": par.offload_serial,
            "threads": self.threads, "parts": self.ranks[0].parts, "ms_per_step": self.step_s * 1e3, "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_rank": self.tokens_per_s / par.world_size as f64, "mfu": self.mfu(), "peak_gflops": self.peaks.mfu / 1e9, "peak_source": self.peaks.mfu_source,
            "mfu_matmul": self.mfu_of(peak), "matmul_peak_gflops": peak / 1e9,
            "mfu_hardware": self.peaks.hardware.as_ref().map(|(f, _)| self.mfu_of(*f)),
            "hardware_peak_gflops": self.peaks.hardware.as_ref().map(|(f, _)| f / 1e9),
            "matmul": distgpt::backend::cpu::blas::choice().describe(),
            "flops_per_token": cfg.flops_per_token(self.t),
            "rss_start_bytes": self.rss_start, "peak_rss_bytes": metrics::peak_rss_bytes(),
            "bubble": self.bubble, "bubble_formula": self.bubble.map(|_| self.formula),
            "ranks": self.ranks.iter().map(|r| serde_json::json!({
                "peak_bytes": {"params": r.peak.params, "grads": r.peak.grads, "optimizer": r.peak.optimizer, "activations": r.peak.activations, "other": r.peak.other, "total": r.peak.total},
                "host_peak_bytes": (!par.offload.is_none()).then(|| serde_json::json!({"params": r.host_peak.params, "grads": r.host_peak.grads, "optimizer": r.host_peak.optimizer, "total": r.host_peak.total})),
                "comm_bytes_per_step": r.comm_bytes_per_step, "comm_seconds_per_step": r.comm_s_per_step,
                "update_seconds_per_step": r.update_s,
            })).collect::<Vec<_>>(),
        });
        if let Some(k) = &self.kernels {
            j["profile"] = k.json();
        }
        distgpt::outln!("{j}");
    }

    /// The figures as text: the step, the peaks it is measured against,
    /// the pipeline's bubble, memory and communication per rank.
    fn print_text(&self) {
        let (a, cfg, par, b, t) = (self.a, self.cfg, self.par, self.b, self.t);
        let (ranks, mfu) = (&self.ranks, self.mfu());
        distgpt::outln!(
            "distgpt {} ({} params) {} x {} (tp {}{}) batch {b} x {t}, {}: {:.1} ms/step, {:.0} tokens/s ({:.0} per rank), MFU {:.1}% of {} GFLOP/s ({})",
            a.model.model_name(),
            cfg.num_params(),
            par.strategy,
            par.world_size,
            par.resolved().tp,
            [
                (par.pipeline.stages > 1).then(|| format!(
                    ", pp {} {}, {} micro-batches",
                    par.pipeline.stages, par.pipeline, self.spec.grad_accum
                )),
                par.recompute.then(|| ", recompute".to_string()),
                (par.precision == Precision::Bf16).then(|| ", bf16".to_string()),
                (ranks[0].parts > 1).then(|| format!(
                    ", {} a rank",
                    metrics::count(ranks[0].parts, "part")
                )),
                (!par.offload.is_none()).then(|| format!(
                    ", offload {}{}",
                    par.offload,
                    if par.offload_serial { " (serial)" } else { "" }
                )),
            ]
            .into_iter()
            .flatten()
            .collect::<String>(),
            metrics::count(self.threads, "thread"),
            self.step_s * 1e3,
            self.tokens_per_s,
            self.tokens_per_s / par.world_size as f64,
            100.0 * mfu,
            // a stated peak below one GFLOP/s reads as its digits, not 0
            match self.peaks.mfu / 1e9 {
                g if g >= 1.0 => format!("{g:.0}"),
                g => format!("{g:.2e}"),
            },
            self.peaks.mfu_source
        );
        if let (Some(_), None) = (&self.peaks.hardware, self.peaks.stated) {
            distgpt::outln!(
                "the best matmul measured {:.0} GFLOP/s ({}); the step ran at {:.1}% of it (a probe of one product's shape, not a bound on a step)",
                self.peaks.matmul / 1e9,
                self.peaks.matmul_source,
                100.0 * self.mfu_of(self.peaks.matmul),
            );
        }
        if let Some(note) = metrics::mfu_above_peak(mfu, self.peaks.stated.is_some()) {
            distgpt::errln!("note: {note}");
        }
        if let Some(b) = self.bubble {
            distgpt::outln!(
                "pipeline bubble: {:.1}% of the program idle, measured (mean over every rank and timed step); \
                 formula {} = {:.1}%",
                100.0 * b,
                par.pipeline.bubble_formula(self.spec.grad_accum),
                100.0 * self.formula
            );
        }
        self.print_memory();
        if let Some(k) = &self.kernels {
            k.print();
        }
    }

    /// The process's RSS, then each rank's peak bytes and communication.
    fn print_memory(&self) {
        let (par, ranks) = (self.par, &self.ranks);
        let h = metrics::human_bytes;
        if let (Some(start), Some(peak)) = (self.rss_start, metrics::peak_rss_bytes()) {
            distgpt::outln!(
                "this process: peak RSS {}, {} above its start (its ranks' counted bytes with the loader, workspaces, thread stacks and allocator)",
                h(peak),
                h(peak.saturating_sub(start))
            );
        }
        for (r, x) in ranks.iter().enumerate() {
            distgpt::outln!(
                "rank {r}: peak {} = params {} + grads {} + optimizer {} + activations {} + other {} | comm {} / step, {:.1} ms / step | update {:.1} ms / step",
                h(x.peak.total),
                h(x.peak.params),
                h(x.peak.grads),
                h(x.peak.optimizer),
                h(x.peak.activations),
                h(x.peak.other),
                h(x.comm_bytes_per_step as u64),
                1e3 * x.comm_s_per_step,
                1e3 * x.update_s
            );
            if r + 1 == ranks.len() && x.peak.other > 0 {
                if let Some(what) = par.strategy.other_memory() {
                    distgpt::outln!("note: {what}");
                }
            }
            if !par.offload.is_none() {
                let p = &x.host_peak;
                distgpt::outln!(
                    "rank {r} host: peak {} = params {} + grads {} + optimizer {}",
                    h(p.total),
                    h(p.params),
                    h(p.grads),
                    h(p.optimizer)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--warmup` runs of `bench --generate` are untimed: the fastest run
    /// is of the timed ones (a warm-up's was the figure when it was fastest).
    #[test]
    fn generation_warm_up_runs_are_not_the_figure() {
        let runs = [(1.0, 0.1, 4), (3.0, 0.3, 4), (2.0, 0.2, 4)];
        assert_eq!(fastest_timed(&runs, 1, 4), (2.0, 0.2, 4));
        assert_eq!(fastest_timed(&runs, 0, 4), (1.0, 0.1, 4));
        // of runs as fast, the first, with its own time to the first token
        let tied = [(2.0, 0.1, 4), (2.0, 0.3, 4)];
        assert_eq!(fastest_timed(&tied, 0, 4), (2.0, 0.1, 4));
    }
}
