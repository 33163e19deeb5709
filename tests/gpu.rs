//! The GPU backends against the CPU's: a whole training step on the same
//! weights, every strategy following `single` on thread ranks, greedy
//! generation, and `train --device`. Each check runs on every device there
//! is: the first OpenCL device (PoCL here) and, in a build with the `cuda`
//! feature, the first CUDA GPU (`scripts/gpu_check.sh`). A missing device
//! skips with a notice, unless DISTGPT_REQUIRE_OPENCL=1 / DISTGPT_REQUIRE_CUDA=1.

mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::opencl::OpenCl;
use distgpt::backend::Backend;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::infer::generate::{generate, SampleConfig};
use distgpt::model::{AdamW, AdamWConfig, Gpt2, GptConfig, Precision, Segment};
use distgpt::parallel::{ParallelConfig, Pipeline, Schedule, StrategyKind};
use distgpt::train::{train_lm, TrainSummary};
use std::sync::OnceLock;
use std::time::Duration;

/// Opens device `DISTGPT_{KIND}_DEVICE` (default 0) of backend `kind`
/// with `open`, or None with a notice unless `DISTGPT_REQUIRE_{KIND}=1`.
fn open_or_skip<B>(kind: &str, open: impl FnOnce(usize) -> distgpt::error::Result<B>) -> Option<B> {
    let upper = kind.to_uppercase();
    let index = std::env::var(format!("DISTGPT_{upper}_DEVICE"))
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    match open(index) {
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

/// Loss, logits, gradients and the parameters after one AdamW update.
fn one_step<B: Backend>(
    be: B,
    cfg: &GptConfig,
    (tokens, targets): (&[u32], &[u32]),
    precision: Precision,
) -> [Vec<f32>; 4] {
    let mut m = Gpt2::new(be.clone_fresh(), cfg.clone()).unwrap();
    m.set_precision(precision);
    m.init_weights(5).unwrap();
    let (b, t) = (3, tokens.len() / 3);
    let loss = m.forward(tokens, Some(targets), b, t).unwrap().unwrap();
    let logits = m.logits(2, t - 1).unwrap();
    m.zero_grads();
    m.backward(1.0).unwrap();
    let grads = m.backend().to_host(m.grads.s()).unwrap();
    let mut opt = AdamW::new(m.backend(), m.layout.total(), AdamWConfig::default()).unwrap();
    let whole = Segment::whole(m.layout.total());
    let lay = m.layout.clone();
    let be = m.backend().clone_fresh();
    opt.update(&be, m.params.d(), m.grads.s(), &lay, &whole, 1e-3, 0.5);
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
    for precision in [Precision::Fp32, Precision::Bf16] {
        let batch = (&tokens[..], &targets[..]);
        let want = one_step(Cpu::new(), &cfg, batch, precision);
        let got = one_step(gpu.clone_fresh(), &cfg, batch, precision);
        for (what, (g, w)) in ["loss", "logits", "gradients", "updated parameters"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            let err = rel_err(g, w);
            eprintln!("{kind} {precision:?} {what}: relative error {err:.2e}");
            assert!(
                err <= 1e-5,
                "{kind} {precision:?} {what}: relative error {err}"
            );
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
    let cfg = common::five_steps(&tag, 1);
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
    let model = common::tiny_model(dataset());
    train_lm(
        make,
        model,
        dataset(),
        &cfg,
        par,
        2,
        Duration::from_secs(300),
    )
    .unwrap_or_else(|e| panic!("{tag}: {e}"))
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

#[test]
fn train_with_device_gpu_follows_the_cpus_losses() {
    on_gpus!(train_with_device_gpu_follows_the_cpus_losses_on);
}

fn train_with_device_gpu_follows_the_cpus_losses_on<B: Backend>(_: B, kind: &str) {
    let run = |device: &str| {
        let out =
            std::env::temp_dir().join(format!("distgpt-gpu-cli-{device}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_distgpt"))
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
    let terms = batch.loss_terms() as f32;
    let loss = m.run_forward(batch, (b, t), terms, None).unwrap().unwrap();
    let out = m.engine.outputs().unwrap();
    m.run_backward(1.0, None, |_, _, _| Ok(())).unwrap();
    (loss, out, m.backend().to_host(m.grads.s()).unwrap())
}

/// A BERT step (the tiny Hugging Face fixtures' weights; padding, token
/// types, ignored targets) on the device equals the CPU's, in fp32 and in
/// bf16: loss, outputs and every gradient.
fn bert_step_matches_cpu_on<B: Backend>(be: B, name: &str) {
    use distgpt::data::{Batch, IGNORE};
    for kind in ["mlm", "cls"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/bert_tiny")
            .join(kind);
        let (cfg, params) = distgpt::model::bert::hf::load_folder(&dir, None, 0).unwrap();
        let (b, t) = (3, 10);
        let mut rng = distgpt::rng::Rng::new(5);
        let targets = match kind {
            "mlm" => (0..b * t)
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
