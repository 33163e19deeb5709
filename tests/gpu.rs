//! The GPU backends against the CPU's: a whole training step on the same
//! weights, every strategy following `single` on thread ranks, greedy
//! generation, and `train --device`. Each check runs on every device there
//! is: the first OpenCL device (PoCL here) and, in a build with the `cuda`
//! feature, the first CUDA GPU (`scripts/gpu_check.sh`). A missing device
//! skips with a notice, unless DISTGPT_REQUIRE_OPENCL=1 / DISTGPT_REQUIRE_CUDA=1.

mod common;

#[path = "support/profile.rs"]
mod profile;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::opencl::OpenCl;
use distgpt::backend::{Backend, Device};
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::{AdamW, AdamWConfig, Gpt2, GptConfig, Precision, Segment};
use distgpt::parallel::Offload;
use distgpt::parallel::{ParallelConfig, Pipeline, Schedule, StrategyKind};
use distgpt::train::{train_lm, TrainConfig, TrainSummary};
use distgpt::{model::gpt2::generate::generate, sample::SampleConfig};
use std::sync::OnceLock;
use std::time::Duration;

/// The device the tests of backend `kind` run on: `DISTGPT_{KIND}_DEVICE`
/// (default 0).
fn gpu_index(kind: &str) -> usize {
    std::env::var(format!("DISTGPT_{}_DEVICE", kind.to_uppercase()))
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Opens device [`gpu_index`] of backend `kind` with `open`, or None with
/// a notice unless `DISTGPT_REQUIRE_{KIND}=1`.
fn open_or_skip<B>(kind: &str, open: impl FnOnce(usize) -> distgpt::error::Result<B>) -> Option<B> {
    let upper = kind.to_uppercase();
    match open(gpu_index(kind)) {
        Ok(d) => Some(d),
        Err(e) if std::env::var(format!("DISTGPT_REQUIRE_{upper}")).as_deref() == Ok("1") => {
            panic!("DISTGPT_REQUIRE_{upper}=1 but {e}")
        }
        Err(e) => {
            eprintln!("skipping the {kind} tests: {e}");
            None
        }
    }
}

fn opencl() -> Option<OpenCl> {
    static DEV: OnceLock<Option<OpenCl>> = OnceLock::new();
    DEV.get_or_init(|| open_or_skip("opencl", OpenCl::open))
        .clone()
}

#[cfg(feature = "cuda")]
fn cuda() -> Option<distgpt::backend::cuda::Cuda> {
    static DEV: OnceLock<Option<distgpt::backend::cuda::Cuda>> = OnceLock::new();
    DEV.get_or_init(|| open_or_skip("cuda", distgpt::backend::cuda::Cuda::open))
        .clone()
}

/// Runs `$check(backend, "kind")` on each GPU backend there is.
macro_rules! on_gpus {
    ($check:ident) => {{
        if let Some(be) = opencl() {
            $check(be, "opencl");
        }
        #[cfg(feature = "cuda")]
        if let Some(be) = cuda() {
            $check(be, "cuda");
        }
    }};
}

fn dataset() -> &'static Dataset {
    static DS: OnceLock<Dataset> = OnceLock::new();
    DS.get_or_init(|| Dataset::load(None, TokenizerKind::Char).unwrap())
}

/// Largest |a - b| over the largest |b| (at least 1).
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Loss, logits, gradients and the parameters after one AdamW update;
/// `chunked`, recomputing with the head in chunks of 7 rows (whose logits
/// are not all held: none returned).
fn one_step<B: Backend>(
    be: B,
    cfg: &GptConfig,
    (tokens, targets): (&[u32], &[u32]),
    (precision, chunked): (Precision, bool),
) -> [Vec<f32>; 4] {
    let mut m = Gpt2::new(be.clone_fresh(), cfg.clone()).unwrap();
    m.set_precision(precision);
    if chunked {
        m.engine.recompute = true;
        m.engine.set_logits_budget(7 * cfg.padded_vocab());
    }
    m.init_weights(5).unwrap();
    let (b, t) = (3, tokens.len() / 3);
    let loss = m.forward(tokens, Some(targets), b, t).unwrap().unwrap();
    let logits = match chunked {
        true => Vec::new(),
        false => m.logits(2, t - 1).unwrap(),
    };
    m.zero_grads();
    m.backward(1.0).unwrap();
    let grads = m.backend().to_host(m.grads.s()).unwrap();
    let mut opt = AdamW::new(m.backend(), m.core.layout.total(), AdamWConfig::default()).unwrap();
    let whole = Segment::whole(m.core.layout.total());
    let lay = m.core.layout.clone();
    let be = m.backend().clone_fresh();
    opt.update(&be, m.params.d(), m.grads.s(), &lay, &whole, 1e-3, 0.5)
        .unwrap();
    be.synchronize().unwrap();
    [vec![loss], logits, grads, m.params_host().unwrap()]
}

#[test]
fn a_training_step_on_the_gpu_equals_the_cpus() {
    on_gpus!(a_training_step_on_the_gpu_equals_the_cpus_on);
}

fn a_training_step_on_the_gpu_equals_the_cpus_on<B: Backend>(gpu: B, kind: &str) {
    // Awkward widths: 3 heads of 8, a block of 19 positions, 67 tokens (padded to 128).
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 3,
        n_embd: 24,
        block_size: 19,
        vocab_size: 67,
        blocks: Vec::new(),
    };
    let tokens: Vec<u32> = (0..3 * 19).map(|i| (i * 31 % 67) as u32).collect();
    let targets: Vec<u32> = (0..3 * 19).map(|i| (i * 17 % 67) as u32).collect();
    // bf16: where the device's f32 differs from the CPU's by an ulp (CUDA
    // contracts to FMA), a value rounded to bf16 can land one bf16 step
    // (2^-8) away; the step's outputs then differ by a fraction of that.
    // A tenth of a bf16 step still fails a step whose rounding to bf16 does
    // nothing (planted on OpenCL: logits 5.4e-4 apart).
    // and each with --recompute's head in chunks of rows (offset views)
    for (precision, tol) in [
        (Precision::Fp32, 1e-5),
        (Precision::Bf16, 2f32.powi(-8) / 10.0),
    ] {
        for chunked in [false, true] {
            let batch = (&tokens[..], &targets[..]);
            let want = one_step(Cpu::new(), &cfg, batch, (precision, chunked));
            let got = one_step(gpu.clone_fresh(), &cfg, batch, (precision, chunked));
            for (what, (g, w)) in ["loss", "logits", "gradients", "updated parameters"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                let err = rel_err(g, w);
                eprintln!(
                    "{kind} {precision:?} chunked {chunked} {what}: relative error {err:.2e}"
                );
                assert!(
                    err <= tol,
                    "{kind} {precision:?} chunked {chunked} {what}: relative error {err} > {tol}"
                );
            }
        }
    }
}

fn run<B: Backend>(
    make: impl Fn() -> B + Sync,
    strategy: StrategyKind,
    world_size: usize,
    tp: usize,
) -> TrainSummary {
    run_pipelined(make, (strategy, world_size, tp), Pipeline::default())
}

fn run_pipelined<B: Backend>(
    make: impl Fn() -> B + Sync,
    (strategy, world_size, tp): (StrategyKind, usize, usize),
    pipeline: Pipeline,
) -> TrainSummary {
    let tag = format!(
        "gpu-{strategy:?}-{world_size}-{tp}-pp{}-{}",
        pipeline.stages, pipeline.schedule
    );
    let par = ParallelConfig {
        strategy,
        world_size,
        tp,
        recompute: false,
        precision: Default::default(),
        pipeline,
        offload: Default::default(),
        offload_serial: false,
    };
    run_par(make, par, &common::five_steps(&tag, 1))
}

/// The tiny model trained under `par` as `cfg` says.
fn run_par<B: Backend>(
    make: impl Fn() -> B + Sync,
    par: ParallelConfig,
    cfg: &TrainConfig,
) -> TrainSummary {
    let model = common::tiny_model(dataset());
    train_lm(
        make,
        model,
        dataset(),
        cfg,
        par,
        2,
        Duration::from_secs(300),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", cfg.out_dir.display()))
}

/// A training step allocates nothing on the device after the first (issue
/// 78): the model's buffers are made once and the kernels' scratch is
/// kept. Two runs, of 2 and of 5 steps, each on a device of its own (no
/// other test's buffers counted), allocate as many buffers: GPT-2 in fp32
/// and bf16, single and on a pipeline of 2 (zb-h1, its backwards split in
/// halves, in fp32; 1f1b in bf16); then BERT, step by step.
/// (The embedding backward's token index, a buffer a step, made the run of
/// 5 steps allocate 3 more.)
#[test]
fn a_training_step_allocates_nothing_on_the_device_after_the_first() {
    // the CPU's buffers are the allocator's: it counts none, not zero
    assert_eq!(Cpu::new().allocations(), None);
    if opencl().is_some() {
        allocations_stay_after_the_first_step(|| OpenCl::open(gpu_index("opencl")), "opencl");
    }
    #[cfg(feature = "cuda")]
    if cuda().is_some() {
        let open = || distgpt::backend::cuda::Cuda::open(gpu_index("cuda"));
        allocations_stay_after_the_first_step(open, "cuda");
    }
}

fn allocations_stay_after_the_first_step<B: Backend>(
    open: impl Fn() -> distgpt::error::Result<B>,
    kind: &str,
) {
    // zb-h1 runs in fp32 only
    for (precision, schedule) in [
        (Precision::Fp32, Schedule::ZbH1),
        (Precision::Bf16, Schedule::OneFOneB),
    ] {
        for (strategy, pipeline) in [
            (StrategyKind::Single, Pipeline::default()),
            (StrategyKind::Ddp, Pipeline::new(2, schedule, 1)),
        ] {
            let what = format!("{kind} {precision:?} {strategy:?} pp {}", pipeline.stages);
            let [two, five] = [2, 5].map(|steps| {
                let be = open().unwrap();
                let par = ParallelConfig {
                    strategy,
                    world_size: pipeline.stages,
                    tp: 1,
                    recompute: false,
                    precision,
                    pipeline,
                    offload: Default::default(),
                    offload_serial: false,
                };
                let tag = format!("allocations-{kind}-{precision:?}-{strategy:?}-{steps}");
                let cfg = TrainConfig {
                    duration: distgpt::train::Duration::Steps(steps),
                    ..common::five_steps(&tag, 1)
                };
                run_par(|| be.clone_fresh(), par, &cfg);
                be.allocations().expect("a GPU counts its allocations")
            });
            eprintln!("{what}: {two} buffers allocated in 2 steps, {five} in 5");
            // counted at all: the model's tensors, activations and moments are dozens
            assert!(
                two > 20,
                "{what}: {two} buffers for a model and its training"
            );
            assert_eq!(two, five, "{what}: buffers allocated in 2 steps and in 5");
        }
    }
    bert_allocations_stay_after_the_first_step(&open, kind);
}

/// BERT's steps, a classifier's and a masked LM's in fp32 and bf16, each
/// over sequences of other lengths: the device's count after the first
/// step is its count after each later one.
fn bert_allocations_stay_after_the_first_step<B: Backend>(
    open: impl Fn() -> distgpt::error::Result<B>,
    kind: &str,
) {
    use distgpt::model::bert::BertHead;
    use distgpt::parallel::{launch, StepConfig};
    let (b, t) = (4, 16);
    for head in [BertHead::Classify { labels: 3 }, BertHead::Mlm] {
        let cfg = common::small_bert(head);
        for precision in [Precision::Fp32, Precision::Bf16] {
            let be = open().unwrap();
            let par = ParallelConfig {
                precision,
                ..ParallelConfig::single()
            };
            let counts = launch::run_local(1, 1, Duration::from_secs(120), |world| {
                let adamw = AdamWConfig::default();
                let mut s = distgpt::parallel::build(
                    be.clone_fresh(),
                    cfg.clone(),
                    par,
                    world.as_ref(),
                    adamw,
                    b,
                    t,
                )?;
                s.load_full(&cfg.init_full(1))?;
                let mut rng = distgpt::rng::Rng::new(5);
                let mut counts = Vec::new();
                for step in 0..4 {
                    let mut batch = cfg.synthetic_batch(&mut rng, b, t);
                    batch.lens = (0..b).map(|i| (1 + (i + step) * 5 % t) as u32).collect();
                    s.step(
                        &[batch],
                        StepConfig {
                            lr: 1e-3,
                            grad_clip: 1.0,
                        },
                    )?;
                    counts.push(be.allocations().expect("a GPU counts its allocations"));
                }
                Ok(counts)
            })
            .unwrap()
            .remove(0);
            let what = format!("{kind} bert {head:?} {precision:?}");
            eprintln!("{what}: buffers allocated by the end of each step {counts:?}");
            assert!(
                counts[0] > 20,
                "{what}: {counts:?} buffers for a model and its training"
            );
            assert!(counts.iter().all(|&n| n == counts[0]), "{what}: {counts:?}");
        }
    }
}

#[test]
fn every_strategy_on_the_gpu_matches_single() {
    on_gpus!(every_strategy_on_the_gpu_matches_single_on);
}

fn every_strategy_on_the_gpu_matches_single_on<B: Backend>(gpu: B, kind: &str) {
    let on_gpu = || gpu.clone_fresh();
    let single = run(on_gpu, StrategyKind::Single, 1, 1);
    common::assert_follows(
        &run(Cpu::new, StrategyKind::Single, 1, 1),
        &single,
        &format!("single on {kind} vs single on cpu"),
    );
    for (strategy, world, tp) in [
        (StrategyKind::Ddp, 2, 1),
        (StrategyKind::Zero1, 2, 1),
        (StrategyKind::Zero2, 2, 1),
        (StrategyKind::Fsdp, 2, 1),
        (StrategyKind::Tp, 2, 2),
        (StrategyKind::Ddp, 4, 2),
    ] {
        let what = format!("{strategy:?} on {world} {kind} ranks, tp {tp}");
        common::assert_follows(&single, &run(on_gpu, strategy, world, tp), &what);
    }
    // pipelines; zb-h1 splits each backward through the backend's halves
    for schedule in [Schedule::OneFOneB, Schedule::ZbH1] {
        let pipe = Pipeline::new(2, schedule, 1);
        let got = run_pipelined(on_gpu, (StrategyKind::Ddp, 2, 1), pipe);
        common::assert_follows(&single, &got, &format!("pp 2 {schedule} on {kind}"));
    }
}

#[test]
fn greedy_generation_on_the_gpu_gives_the_cpus_tokens() {
    on_gpus!(greedy_generation_on_the_gpu_gives_the_cpus_tokens_on);
}

fn greedy_generation_on_the_gpu_gives_the_cpus_tokens_on<B: Backend>(gpu: B, kind: &str) {
    let cfg = common::tiny_model(dataset());
    let sc = SampleConfig {
        max_new_tokens: 40,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let prompts = vec![vec![1, 2, 3], vec![7, 5, 9, 11, 2]];
    let mut on_cpu = Gpt2::new(Cpu::new(), cfg.clone()).unwrap();
    on_cpu.init_weights(9).unwrap();
    let mut on_gpu = Gpt2::new(gpu, cfg).unwrap();
    on_gpu.set_params(&on_cpu.params_host().unwrap()).unwrap();
    let want = generate(&on_cpu, &prompts, &sc, None, |_, _| {}).unwrap();
    let got = generate(&on_gpu, &prompts, &sc, None, |_, _| {}).unwrap();
    assert_eq!(got, want, "greedy tokens on {kind}");
}

/// Per-step losses from a run's metrics.jsonl.
fn losses(run: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}

/// `bench --profile` on a GPU: the queue finished around each kernel, each
/// counted as the model runs it, with the model's FLOPs.
#[test]
fn bench_profile_on_a_gpu_counts_the_models_kernels() {
    on_gpus!(bench_profile_on_a_gpu_counts_the_models_kernels_on);
}

fn bench_profile_on_a_gpu_counts_the_models_kernels_on<B: Backend>(_: B, kind: &str) {
    let row = profile::profiled_tiny_bench(&common::distgpt_bin(), &["--device", kind]);
    assert_eq!(row["parts"].as_u64(), Some(1), "{row}");
    profile::assert_profile_counts_tiny(&row, 1.0, 1.0, kind);
}

#[test]
fn train_with_device_gpu_follows_the_cpus_losses() {
    on_gpus!(train_with_device_gpu_follows_the_cpus_losses_on);
}

fn train_with_device_gpu_follows_the_cpus_losses_on<B: Backend>(_: B, kind: &str) {
    let run = |device: &str| {
        let out = common::scratch(&format!("gpu-cli-{device}"));
        let status = std::process::Command::new(common::distgpt_bin())
            .stdout(std::process::Stdio::null())
            .args([
                "train",
                "--model",
                "tiny",
                "--steps",
                "8",
                "--batch-size",
                "4",
            ])
            .args(["--eval-every", "0", "--sample-tokens", "0", "--quiet"])
            .args(["--peak-tflops", "0.1", "--device", device, "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(status.success(), "train --device {device} failed");
        let l = losses(&out);
        // a bare resume trains on the device the run did
        let resumed = std::process::Command::new(common::distgpt_bin())
            .args(["train", "--resume"])
            .arg(&out)
            .args(["--steps", "9", "--quiet"])
            .output()
            .unwrap();
        assert!(
            resumed.status.success(),
            "{}",
            String::from_utf8_lossy(&resumed.stderr)
        );
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
        let segments = record["segments"].as_array().unwrap();
        assert_eq!(segments.len(), 2);
        for s in segments {
            let on = s["device"].as_str().unwrap();
            assert!(on.starts_with(device), "a segment on {on}, not {device}");
        }
        let _ = std::fs::remove_dir_all(&out);
        l
    };
    let (cpu, gpu) = (run("cpu"), run(kind));
    assert_eq!(cpu.len(), 8);
    assert_eq!(gpu.len(), cpu.len());
    for (step, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5,
            "step {step}: {kind} loss {a} vs cpu {b}"
        );
    }
}

/// A resume that turns the offload off takes the copies' order along: a
/// run trained with `--offload optimizer --offload-serial` resumes with
/// `--offload none` (no flag clears `--offload-serial`).
#[test]
fn a_resume_without_offload_leaves_its_serial_order_behind() {
    on_gpus!(a_resume_without_offload_leaves_its_serial_order_behind_on);
}

fn a_resume_without_offload_leaves_its_serial_order_behind_on<B: Backend>(_: B, kind: &str) {
    let out = common::scratch(&format!("gpu-offload-serial-{kind}"));
    let dir = out.to_str().unwrap();
    let train = |args: &[&str]| {
        let o = std::process::Command::new(common::distgpt_bin())
            .arg("train")
            .args(args)
            .args(["--steps", "2", "--quiet"])
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, said) = train(&[
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--device",
        kind,
        "--offload",
        "optimizer",
        "--offload-serial",
        "--stop-after",
        "1",
        "--out",
        dir,
    ]);
    assert_eq!(code, Some(75), "{said}");
    let (code, said) = train(&["--resume", dir, "--offload", "none"]);
    assert_eq!(code, Some(0), "{said}");
    let _ = std::fs::remove_dir_all(&out);
}

/// Under offload, `train` states every rank's host memory, as `bench`
/// counts it for the same layout (a pipeline's stages hold different
/// parts): it printed rank 0's alone, and metrics.jsonl kept none per rank.
#[test]
fn train_states_every_ranks_offloaded_host_memory_as_bench_does() {
    on_gpus!(train_states_every_ranks_offloaded_host_memory_as_bench_does_on);
}

fn train_states_every_ranks_offloaded_host_memory_as_bench_does_on<B: Backend>(_: B, kind: &str) {
    let out = common::scratch(&format!("gpu-offload-ranks-{kind}"));
    let layout = [
        &["--model", "tiny", "--batch-size", "4", "--seq-len", "16"][..],
        &["--strategy", "zero2", "--world-size", "4", "--pp", "2"],
        &[
            "--offload",
            "optimizer",
            "--device",
            kind,
            "--peak-tflops",
            "0.1",
        ],
    ]
    .concat();
    let run = |args: &[&str]| {
        let o = std::process::Command::new(common::distgpt_bin())
            .args(args)
            .args(&layout)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{args:?}: {said}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let printed = run(&[
        "train",
        "--steps",
        "1",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let host = |row: &serde_json::Value| row[5].as_u64().unwrap();
    let trained: Vec<u64> = last["rank_host_peak_bytes"]
        .as_array()
        .unwrap_or_else(|| panic!("no host peaks per rank: {last}"))
        .iter()
        .map(host)
        .collect();
    let bench: serde_json::Value =
        serde_json::from_str(&run(&["bench", "--steps", "1", "--warmup", "0", "--json"])).unwrap();
    let benched: Vec<u64> = bench["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["host_peak_bytes"]["total"].as_u64().unwrap())
        .collect();
    assert_eq!(trained, benched, "train's host peaks a rank, bench's");
    assert!(trained.iter().any(|&t| t != trained[0]), "{trained:?}");
    for r in 0..4 {
        let line = printed
            .lines()
            .find(|l| l.starts_with(&format!("rank {r}: ")))
            .unwrap_or_else(|| panic!("no line for rank {r}: {printed}"));
        assert!(line.contains(" | host (offload) "), "{line}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// bf16 on a GPU is right and repeatable: 200 steps of the tiny GPT-2
/// (heads of 16, so bf16 attention runs on flash.cu's fused kernels where
/// the GPU has tensor cores) end within 1% of fp32's validation loss, and
/// a second bf16 run repeats the first's losses bit for bit.
#[test]
fn bf16_training_follows_fp32_and_repeats_bit_for_bit() {
    on_gpus!(bf16_training_follows_fp32_and_repeats_bit_for_bit_on);
}

fn bf16_training_follows_fp32_and_repeats_bit_for_bit_on<B: Backend>(_: B, kind: &str) {
    let run = |precision: &str, tag: &str| {
        let out = common::scratch(&format!("gpu-{precision}-{tag}"));
        let status = std::process::Command::new(common::distgpt_bin())
            .stdout(std::process::Stdio::null())
            .args(["train", "--model", "tiny", "--steps", "200"])
            .args(["--batch-size", "8", "--precision", precision])
            .args(["--eval-every", "200", "--eval-batches", "8"])
            .args(["--sample-tokens", "0", "--quiet", "--peak-tflops", "0.1"])
            .args(["--device", kind, "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "train --precision {precision} on {kind} failed"
        );
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let field = |name: &str| -> Vec<u64> {
            (rows.iter().filter_map(|r| r.get(name)?.as_f64()))
                .map(f64::to_bits)
                .collect()
        };
        let _ = std::fs::remove_dir_all(&out);
        (field("loss"), field("val_loss"))
    };
    let (fp32, fp32_val) = run("fp32", kind);
    let (bf16, bf16_val) = run("bf16", kind);
    let (again, again_val) = run("bf16", &format!("{kind}-again"));
    assert_eq!((bf16.len(), bf16_val.len()), (200, 1), "{kind}");
    assert!(
        bf16 == again && bf16_val == again_val,
        "two bf16 runs on {kind} differ"
    );
    assert_ne!(bf16, fp32, "bf16 on {kind} trained as fp32 does");
    let [f, b] = [fp32_val[0], bf16_val[0]].map(f64::from_bits);
    eprintln!("{kind}: validation loss after 200 steps fp32 {f:.5}, bf16 {b:.5}");
    assert!(
        (b - f).abs() <= 0.01 * f,
        "{kind}: bf16's validation loss {b} is not within 1% of fp32's {f}"
    );
}

/// Loss, outputs and gradients of one BERT step on `be`.
fn bert_step<B: Backend>(
    be: B,
    cfg: &distgpt::model::bert::BertConfig,
    params: &[f32],
    batch: &distgpt::data::Batch,
    (b, t): (usize, usize),
    precision: Precision,
) -> (f32, Vec<f32>, Vec<f32>) {
    use distgpt::model::bert::Engine;
    use distgpt::model::{TpPlace, UnitModel, Whole};
    let engine = Engine::new(be, cfg.clone(), TpPlace::NONE, false, precision).unwrap();
    let mut m = Whole::with_engine(engine).unwrap();
    m.load_full(params).unwrap();
    m.zero_grads();
    let terms = batch.loss_terms();
    let loss = m.run_forward(batch, (b, t), terms, None).unwrap().unwrap();
    let out = m.engine.outputs().unwrap();
    m.run_backward(1.0, None, |_, _, _| Ok(())).unwrap();
    (loss, out, m.backend().to_host(m.grads.s()).unwrap())
}

/// A BERT step (the tiny Hugging Face fixtures' weights: masked LM,
/// classifier, pretraining; padding, token types, ignored targets) on the device equals the CPU's, in fp32 and in
/// bf16: loss, outputs and every gradient.
fn bert_step_matches_cpu_on<B: Backend>(be: B, name: &str) {
    use distgpt::data::{Batch, IGNORE};
    for kind in ["mlm", "cls", "pretrain"] {
        let dir = common::repo().join("tests/fixtures/bert_tiny").join(kind);
        let (cfg, params) = distgpt::model::bert::hf::load_folder(&dir, None, 0).unwrap();
        let (b, t) = (3, 10);
        let mut rng = distgpt::rng::Rng::new(5);
        let targets = match kind {
            "mlm" | "pretrain" => (0..b * t)
                .map(|i| match i % 3 {
                    0 => IGNORE,
                    _ => rng.below(cfg.vocab_size) as u32,
                })
                .collect(),
            _ => vec![0, 2, 1],
        };
        let batch = Batch {
            inputs: (0..b * t)
                .map(|_| rng.below(cfg.vocab_size) as u32)
                .collect(),
            targets,
            types: (0..b * t).map(|i| (i % 2) as u32).collect(),
            lens: vec![10, 7, 1],
            seq_targets: match kind {
                "pretrain" => vec![0, 1, 1],
                _ => Vec::new(),
            },
        };
        for precision in [Precision::Fp32, Precision::Bf16] {
            let want = bert_step(Cpu::new(), &cfg, &params, &batch, (b, t), precision);
            let got = bert_step(be.clone_fresh(), &cfg, &params, &batch, (b, t), precision);
            let what = format!("{name} {kind} {precision:?}");
            assert!(
                (got.0 - want.0).abs() <= 1e-5 * want.0.abs().max(1.0),
                "{what}: loss {} vs {}",
                got.0,
                want.0
            );
            assert!(
                rel_err(&got.1, &want.1) <= 1e-5,
                "{what}: outputs {}",
                rel_err(&got.1, &want.1)
            );
            assert!(
                rel_err(&got.2, &want.2) <= 1e-5,
                "{what}: gradients {}",
                rel_err(&got.2, &want.2)
            );
        }
    }
}

#[test]
fn bert_step_matches_cpu() {
    on_gpus!(bert_step_matches_cpu_on);
}

/// The layouts offload is checked on: each data-parallel sharing, tensor
/// parallelism and a pipeline, with the offloads that apply to each.
fn offload_layouts() -> Vec<(ParallelConfig, Offload)> {
    let one = |strategy, world_size, tp, stages| ParallelConfig {
        strategy,
        world_size,
        tp,
        recompute: false,
        precision: Default::default(),
        pipeline: Pipeline::new(stages, Schedule::OneFOneB, 1),
        offload: Offload::None,
        offload_serial: false,
    };
    let mut out = Vec::new();
    for par in [
        one(StrategyKind::Single, 1, 1, 1),
        one(StrategyKind::Ddp, 2, 1, 1),
        one(StrategyKind::Zero1, 2, 1, 1),
        one(StrategyKind::Zero2, 2, 1, 1),
        one(StrategyKind::Fsdp, 2, 1, 1),
        one(StrategyKind::Tp, 2, 2, 1),
        one(StrategyKind::Ddp, 2, 1, 2),
        one(StrategyKind::Fsdp, 4, 1, 2),
    ] {
        out.push((par, Offload::Optimizer));
        if par.strategy == StrategyKind::Fsdp {
            out.push((par, Offload::Params));
        }
    }
    out
}

fn layout_tag(par: &ParallelConfig, offload: Offload) -> String {
    format!(
        "{}-x{}-tp{}-pp{}-{offload}",
        par.strategy, par.world_size, par.tp, par.pipeline.stages
    )
}

#[test]
fn offload_follows_the_run_without_it_on_every_layout() {
    on_gpus!(offload_follows_the_run_without_it_on);
}

fn offload_follows_the_run_without_it_on<B: Backend>(gpu: B, kind: &str) {
    let on_gpu = || gpu.clone_fresh();
    for (par, offload) in offload_layouts() {
        let tag = layout_tag(&par, offload);
        let plain = run_par(
            on_gpu,
            par,
            &common::five_steps(&format!("{kind}-{tag}-plain"), 2),
        );
        let with = ParallelConfig { offload, ..par };
        let got = run_par(
            on_gpu,
            with,
            &common::five_steps(&format!("{kind}-{tag}"), 2),
        );
        common::assert_follows(&plain, &got, &format!("{tag} on {kind}"));
        // the copies overlapped or one after another: the same arithmetic
        let serial = ParallelConfig {
            offload_serial: true,
            ..with
        };
        let again = run_par(
            on_gpu,
            serial,
            &common::five_steps(&format!("{kind}-{tag}-serial"), 2),
        );
        assert_eq!(again.losses, got.losses, "{tag} on {kind}: serial copies");
        assert!(again.params == got.params, "{tag} on {kind}: serial copies");
    }
}

#[test]
fn an_offloaded_run_resumes_bit_exactly() {
    on_gpus!(an_offloaded_run_resumes_bit_exactly_on);
}

fn an_offloaded_run_resumes_bit_exactly_on<B: Backend>(gpu: B, kind: &str) {
    let on_gpu = || gpu.clone_fresh();
    for (par, offload) in offload_layouts()
        .into_iter()
        .filter(|(p, _)| p.world_size == 2 && p.pipeline.stages == 1)
    {
        let par = ParallelConfig { offload, ..par };
        let tag = format!("{kind}-resume-{}", layout_tag(&par, offload));
        let whole = run_par(on_gpu, par, &common::five_steps(&format!("{tag}-whole"), 1));
        let cfg = common::five_steps(&tag, 1);
        let first = run_par(
            on_gpu,
            par,
            &TrainConfig {
                stop_after: Some(3),
                ..cfg.clone()
            },
        );
        let second = run_par(
            on_gpu,
            par,
            &TrainConfig {
                resume: Some(distgpt::checkpoint::state::latest(&cfg.out_dir).unwrap()),
                ..cfg
            },
        );
        let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
        assert_eq!(losses, whole.losses, "{tag}: per-step losses");
        assert!(second.params == whole.params, "{tag}: final weights");
    }
}

/// One step's peak bytes per rank on the device and on the host.
fn offload_peaks<B: Backend>(
    gpu: &B,
    cfg: &distgpt::model::ModelConfig,
    par: ParallelConfig,
) -> Vec<([u64; 6], [u64; 6])> {
    use distgpt::train::bench::{bench_rank, BenchSpec};
    let spec = BenchSpec {
        batch: 8,
        grad_accum: 1,
        seq_len: 32,
        warmup: 0,
        steps: 1,
        show: false,
        profile: false,
    };
    let ranks =
        distgpt::parallel::launch::run_local(par.world_size, 2, Duration::from_secs(120), |c| {
            bench_rank(gpu.clone_fresh(), cfg, par, spec, c.as_ref())
        })
        .unwrap();
    ranks[0]
        .iter()
        .map(|r| (r.peak.into(), r.host_peak.into()))
        .collect()
}

/// `model` with the batch `offload_peaks` runs, as `plan` sees it on a GPU.
fn planned(model: &distgpt::model::ModelConfig) -> distgpt::plan::Workload {
    distgpt::plan::Workload {
        model: model.clone(),
        batch: 8,
        seq_len: 32,
        grad_accum: 1,
        cpu_threads: None,
    }
}

/// Offload moves the optimizer's bytes from the device to the host, byte
/// for byte, and `plan` predicts both peaks within 10%.
#[test]
fn offload_moves_the_optimizer_to_the_host_as_planned() {
    on_gpus!(offload_moves_the_optimizer_to_the_host_as_planned_on);
}

fn offload_moves_the_optimizer_to_the_host_as_planned_on<B: Backend>(gpu: B, kind: &str) {
    use distgpt::plan::{self, Precision as PlanPrecision};
    let cfg: distgpt::model::ModelConfig = common::tiny_model(dataset()).into();
    let w = planned(&cfg);
    let (optimizer, total) = (2, 5);
    for (par, offload) in offload_layouts() {
        let tag = format!("{} on {kind}", layout_tag(&par, offload));
        let plain = offload_peaks(&gpu, &cfg, par);
        let with = ParallelConfig { offload, ..par };
        let got = offload_peaks(&gpu, &cfg, with);
        for (r, ((dev0, host0), (dev, host))) in plain.iter().zip(&got).enumerate() {
            assert_eq!(
                host0[total], 0,
                "{tag} rank {r}: host bytes without offload"
            );
            assert_eq!(dev[optimizer], 0, "{tag} rank {r}: device optimizer bytes");
            assert_eq!(
                host[optimizer], dev0[optimizer],
                "{tag} rank {r}: the host holds the device's optimizer bytes"
            );
            let stage = distgpt::parallel::Grid::of(&with).coords(r).stage;
            let want = plan::stage_memory_plan(&w, with, PlanPrecision::Fp32, stage);
            for (what, want, got) in [
                ("device", want.total(), dev[total]),
                ("host", want.host.total(), host[total]),
            ] {
                let off = (want - got as f64).abs() / got as f64;
                assert!(
                    off <= 0.10,
                    "{tag} rank {r}: {what} peak planned {want:.0} bytes, measured {got} ({:.1}% off)",
                    100.0 * off
                );
            }
        }
    }
}

/// --precision bf16 on a GPU makes no copies of the matmul operands (its
/// matmuls round them in the runtime's scratch) and holds the activations
/// autocast holds in bf16 so: `plan` predicts fp32's bytes less half of
/// those and the engines allocate them. (Before the GEMMs rounded, a GPU's
/// engines held rounded copies: 0 more failed.)
#[test]
fn bf16_holds_fp32s_bytes_on_the_gpu() {
    on_gpus!(bf16_holds_fp32s_bytes_on);
}

fn bf16_holds_fp32s_bytes_on<B: Backend>(gpu: B, kind: &str) {
    use distgpt::model::bert::BertHead;
    use distgpt::plan::{self, Precision as PlanPrecision};
    let bert = common::small_bert(BertHead::Classify { labels: 3 });
    let total = 5;
    for cfg in [common::tiny_model(dataset()).into(), bert] {
        let w = planned(&cfg);
        let layouts = offload_layouts().into_iter();
        for (par, _) in layouts.filter(|(_, offload)| *offload == Offload::Optimizer) {
            let [fp32, bf16] = [Precision::Fp32, Precision::Bf16].map(|precision| {
                let par = ParallelConfig { precision, ..par };
                let planned = plan::stage_memory_plan(&w, par, PlanPrecision::Fp32, 0).total();
                (planned, offload_peaks(&gpu, &cfg, par)[0].0[total] as f64)
            });
            let (want, got) = (bf16.0 - fp32.0, bf16.1 - fp32.1);
            // every rank runs blocks, whose MLP activations are bf16
            assert!(
                want == got && want < 0.0,
                "{cfg} {} on {kind} in bf16: planned {want:.0} more bytes than fp32, measured \
                 {got:.0} more",
                par.layout_name()
            );
        }
    }
}

/// Offload on the CPU, or of parameters a strategy does not shard, is
/// refused with the reason (the layout is checked before the device).
#[test]
fn offload_is_refused_where_it_means_nothing() {
    let cfg = common::tiny_model(dataset());
    let par = |strategy, offload| ParallelConfig {
        strategy,
        world_size: 2,
        tp: 1,
        recompute: false,
        precision: Default::default(),
        pipeline: Pipeline::default(),
        offload,
        offload_serial: false,
    };
    for (p, says) in [
        (
            par(StrategyKind::Ddp, Offload::Optimizer),
            "keeps everything in host memory already",
        ),
        (
            par(StrategyKind::Zero2, Offload::Params),
            "use --strategy fsdp",
        ),
    ] {
        let err = distgpt::parallel::launch::run_local(2, 1, Duration::from_secs(30), |c| {
            let adamw = AdamWConfig::default();
            distgpt::parallel::build(Cpu::new(), cfg.clone(), p, c.as_ref(), adamw, 8, 32)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(says), "{err}");
    }
}
