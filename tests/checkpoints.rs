//! Training-state checkpoints: bit-exact resume, resharding into another
//! strategy and world size, and corruption that is detected, never loaded.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::checkpoint::state;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::parallel::{ParallelConfig, Pipeline, Schedule, StrategyKind};
use distgpt::train::run_dir::read_metrics;
use distgpt::train::{train_lm, Duration, TrainConfig, TrainSummary};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration as Wait;

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::load_model;

fn dataset() -> &'static Dataset {
    static DS: OnceLock<Dataset> = OnceLock::new();
    DS.get_or_init(|| Dataset::load(None, TokenizerKind::Char).unwrap())
}

fn out(tag: &str) -> PathBuf {
    scratch(&format!("ckpt-{tag}"))
}

fn config(dir: &Path) -> TrainConfig {
    TrainConfig {
        batch_size: 8,
        seq_len: 32,
        duration: Duration::Steps(6),
        lr: 1e-3,
        warmup_steps: 2,
        seed: 5,
        out_dir: dir.to_path_buf(),
        peak_flops: Some(1e11),
        ..TrainConfig::default()
    }
}

fn run(cfg: &TrainConfig, strategy: StrategyKind, world_size: usize) -> TrainSummary {
    run_tp(cfg, strategy, world_size, 1)
}

fn run_tp(cfg: &TrainConfig, strategy: StrategyKind, world_size: usize, tp: usize) -> TrainSummary {
    run_pp(cfg, strategy, world_size, tp, 1)
}

fn run_pp(
    cfg: &TrainConfig,
    strategy: StrategyKind,
    world_size: usize,
    tp: usize,
    stages: usize,
) -> TrainSummary {
    let pipeline = Pipeline::new(stages, Schedule::OneFOneB, 1);
    run_on(cfg, (strategy, world_size, tp, pipeline), 2)
}

/// A run of the tiny model with `n_layer` blocks.
fn run_on(
    cfg: &TrainConfig,
    (strategy, world_size, tp, pipeline): (StrategyKind, usize, usize, Pipeline),
    n_layer: usize,
) -> TrainSummary {
    let ds = dataset();
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    model.n_layer = n_layer;
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
    train_lm(Cpu::new, model, ds, cfg, par, 2, Wait::from_secs(60)).unwrap()
}

fn resume(dir: &Path, strategy: StrategyKind, world_size: usize) -> TrainSummary {
    let cfg = TrainConfig {
        resume: Some(state::latest(dir).unwrap()),
        ..config(dir)
    };
    run(&cfg, strategy, world_size)
}

#[test]
fn stop_and_resume_is_bit_exact_for_single_ddp_and_fsdp() {
    for (strategy, n) in [
        (StrategyKind::Single, 1),
        (StrategyKind::Ddp, 2),
        (StrategyKind::Fsdp, 2),
    ] {
        let whole = run(&config(&out(&format!("whole-{strategy:?}"))), strategy, n);
        let dir = out(&format!("split-{strategy:?}"));
        let first = run(
            &TrainConfig {
                stop_after: Some(3),
                ..config(&dir)
            },
            strategy,
            n,
        );
        assert_eq!(first.losses.len(), 3);
        let second = resume(&dir, strategy, n);
        let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
        assert_eq!(losses, whole.losses, "{strategy:?}: per-step losses");
        assert!(
            second.params == whole.params,
            "{strategy:?}: final weights differ"
        );
        // metrics.jsonl counts the bytes sent from the run's first step on,
        // across the resume, as the uninterrupted run's does
        let sent = |dir: &Path| -> Vec<u64> {
            let records = read_metrics(dir).unwrap();
            records.iter().map(|r| r.comm.total_bytes()).collect()
        };
        let whole_sent = sent(&whole.out_dir);
        assert_eq!(sent(&dir), whole_sent, "{strategy:?}: bytes sent by step");
        assert_eq!(whole_sent[5] > whole_sent[2], n > 1, "{strategy:?}");
    }
}

/// (strategy, world size, tp) of every layout that owns its state differently.
const LAYOUTS: [(StrategyKind, usize, usize); 4] = [
    (StrategyKind::Tp, 2, 2),
    (StrategyKind::Zero1, 2, 1),
    (StrategyKind::Zero2, 2, 1),
    (StrategyKind::Ddp, 4, 2),
];

#[test]
fn stop_and_resume_is_bit_exact_for_tp_zero1_zero2_and_the_mesh() {
    for (strategy, n, tp) in LAYOUTS {
        let what = format!("{strategy:?} x{n} tp {tp}");
        let whole = run_tp(&config(&out(&format!("whole-{what}"))), strategy, n, tp);
        let dir = out(&format!("split-{what}"));
        let first = run_tp(
            &TrainConfig {
                stop_after: Some(3),
                ..config(&dir)
            },
            strategy,
            n,
            tp,
        );
        let second = run_tp(
            &TrainConfig {
                resume: Some(state::latest(&dir).unwrap()),
                ..config(&dir)
            },
            strategy,
            n,
            tp,
        );
        let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
        assert_eq!(losses, whole.losses, "{what}: per-step losses");
        assert!(
            second.params == whole.params,
            "{what}: final weights differ"
        );
    }
}

/// A pipeline stops and resumes bit-exactly in its own layout (2 stages x 2
/// replicas, and 2 stages x tp 2), and its checkpoint resumes as single, as
/// single's resumes as the pipeline.
#[test]
fn pipelines_resume_bit_exactly_and_reshard_to_and_from_single() {
    let single = run(&config(&out("pp-single")), StrategyKind::Single, 1);
    for (strategy, n, tp) in [
        (StrategyKind::Ddp, 4, 1),
        (StrategyKind::Tp, 4, 2),
        (StrategyKind::Zero2, 4, 1),
        (StrategyKind::Fsdp, 8, 2),
    ] {
        let what = format!("{strategy:?} x{n} tp {tp} pp 2");
        let whole = run_pp(
            &config(&out(&format!("pp-whole-{what}"))),
            strategy,
            n,
            tp,
            2,
        );
        let dir = out(&format!("pp-split-{what}"));
        let stopped = TrainConfig {
            stop_after: Some(3),
            ..config(&dir)
        };
        let first = run_pp(&stopped, strategy, n, tp, 2);
        let resumed = TrainConfig {
            resume: Some(state::latest(&dir).unwrap()),
            ..config(&dir)
        };
        let second = run_pp(&resumed, strategy, n, tp, 2);
        let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
        assert_eq!(losses, whole.losses, "{what}: per-step losses");
        assert!(
            second.params == whole.params,
            "{what}: final weights differ"
        );
        // the pipeline's step-3 checkpoint continues as single, and back
        let as_single = TrainConfig {
            resume: Some(state::at_step(&dir, 3).unwrap()),
            stop_after: Some(1),
            ..config(&out(&format!("pp-to-single-{what}")))
        };
        let next = run(&as_single, StrategyKind::Single, 1);
        let (got, want) = (next.losses[0], single.losses[3]);
        assert!(
            (got - want).abs() <= 1e-5,
            "{what} -> single: step 4 loss {got} vs {want}"
        );
    }
    let dir = out("pp-from-single");
    run(
        &TrainConfig {
            stop_after: Some(3),
            ..config(&dir)
        },
        StrategyKind::Single,
        1,
    );
    let into_pp = TrainConfig {
        resume: Some(state::latest(&dir).unwrap()),
        stop_after: Some(1),
        ..config(&out("pp-from-single-next"))
    };
    for (strategy, n, tp) in [(StrategyKind::Ddp, 4, 1), (StrategyKind::Fsdp, 8, 2)] {
        let into_pp = TrainConfig {
            out_dir: out(&format!("pp-from-single-next-{strategy}")),
            ..into_pp.clone()
        };
        let next = run_pp(&into_pp, strategy, n, tp, 2);
        let (got, want) = (next.losses[0], single.losses[3]);
        assert!(
            (got - want).abs() <= 1e-5,
            "single -> {strategy} x{n} tp {tp} pp 2: step 4 loss {got} vs {want}"
        );
    }
}

/// An interleaved pipeline (2 stages, 2 chunks each, over replicas or a
/// sharded tp mesh) and a zb-h1 one stop and resume bit-exactly, and their
/// checkpoints continue as single and as a plain 1f1b pipeline; single's
/// continues interleaved. Four blocks, two micro-batches a step.
#[test]
fn interleaved_and_zero_bubble_pipelines_resume_bit_exactly_and_reshard() {
    let accum = |dir: &Path| TrainConfig {
        grad_accum: 2,
        ..config(dir)
    };
    let inter = Pipeline::new(2, Schedule::Interleaved, 2);
    let plain = Pipeline::new(1, Schedule::OneFOneB, 1);
    let single = run_on(
        &accum(&out("pp-v2-single")),
        (StrategyKind::Single, 1, 1, plain),
        4,
    );
    let zb = Pipeline::new(2, Schedule::ZbH1, 1);
    for (strategy, n, tp, pipe) in [
        (StrategyKind::Zero1, 4, 1, inter),
        (StrategyKind::Fsdp, 8, 2, inter),
        (StrategyKind::Zero2, 4, 1, zb),
    ] {
        let what = format!("{strategy} x{n} tp {tp} pp 2 {pipe}");
        let layout = (strategy, n, tp, pipe);
        let whole = run_on(&accum(&out(&format!("pp-v2-whole-{what}"))), layout, 4);
        let dir = out(&format!("pp-v2-split-{what}"));
        let stopped = TrainConfig {
            stop_after: Some(3),
            ..accum(&dir)
        };
        let first = run_on(&stopped, layout, 4);
        let resumed = TrainConfig {
            resume: Some(state::latest(&dir).unwrap()),
            ..accum(&dir)
        };
        let second = run_on(&resumed, layout, 4);
        let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
        assert_eq!(losses, whole.losses, "{what}: per-step losses");
        assert!(
            second.params == whole.params,
            "{what}: final weights differ"
        );
        for (name, other) in [
            ("single", (StrategyKind::Single, 1, 1, plain)),
            (
                "ddp x2 pp 2 1f1b",
                (
                    StrategyKind::Ddp,
                    2,
                    1,
                    Pipeline::new(2, Schedule::OneFOneB, 1),
                ),
            ),
        ] {
            let next = TrainConfig {
                resume: Some(state::at_step(&dir, 3).unwrap()),
                stop_after: Some(1),
                ..accum(&out(&format!("pp-v2-to-{name}-{what}")))
            };
            let (got, want) = (run_on(&next, other, 4).losses[0], single.losses[3]);
            assert!(
                (got - want).abs() <= 1e-5,
                "{what} -> {name}: step 4 loss {got} vs {want}"
            );
        }
    }
    let dir = out("pp-v2-from-single");
    let first = TrainConfig {
        stop_after: Some(3),
        ..accum(&dir)
    };
    run_on(&first, (StrategyKind::Single, 1, 1, plain), 4);
    let next = TrainConfig {
        resume: Some(state::latest(&dir).unwrap()),
        stop_after: Some(1),
        ..accum(&out("pp-v2-from-single-next"))
    };
    let got = run_on(&next, (StrategyKind::Fsdp, 8, 2, inter), 4).losses[0];
    let want = single.losses[3];
    assert!(
        (got - want).abs() <= 1e-5,
        "single -> fsdp x8 tp 2 pp 2 interleaved: step 4 loss {got} vs {want}"
    );
}

#[test]
fn every_layout_resumes_into_every_other_and_into_single() {
    let whole = run(&config(&out("cross-whole")), StrategyKind::Single, 1);
    for (from, n, tp) in LAYOUTS {
        let dir = out(&format!("cross-{from:?}-{n}-{tp}"));
        run_tp(
            &TrainConfig {
                stop_after: Some(3),
                ..config(&dir)
            },
            from,
            n,
            tp,
        );
        let snapshot = state::latest(&dir).unwrap();
        for (to, m, to_tp) in LAYOUTS
            .into_iter()
            .chain([(StrategyKind::Single, 1, 1)])
            .filter(|&l| l != (from, n, tp))
        {
            let cfg = TrainConfig {
                resume: Some(snapshot.clone()),
                stop_after: Some(1),
                ..config(&out(&format!("cross-{from:?}-to-{to:?}-{m}-{to_tp}")))
            };
            let next = run_tp(&cfg, to, m, to_tp);
            let (got, want) = (next.losses[0], whole.losses[3]);
            assert!(
                (got - want).abs() <= 1e-5,
                "{from:?} x{n} tp {tp} -> {to:?} x{m} tp {to_tp}: step 4 loss {got} vs {want}"
            );
        }
    }
}

#[test]
fn fsdp_on_four_ranks_resumes_as_ddp_on_two_and_as_single() {
    let whole = run(&config(&out("fsdp4-whole")), StrategyKind::Fsdp, 4);
    let dir = out("fsdp4");
    run(
        &TrainConfig {
            stop_after: Some(3),
            ..config(&dir)
        },
        StrategyKind::Fsdp,
        4,
    );
    let snapshot = state::latest(&dir).unwrap();
    for (strategy, n) in [(StrategyKind::Ddp, 2), (StrategyKind::Single, 1)] {
        let cfg = TrainConfig {
            resume: Some(snapshot.clone()),
            stop_after: Some(1),
            ..config(&out(&format!("re-{strategy:?}")))
        };
        let next = run(&cfg, strategy, n);
        let (got, want) = (next.losses[0], whole.losses[3]);
        assert!(
            (got - want).abs() <= 1e-5,
            "{strategy:?} x{n}: step 4 loss {got} vs {want}"
        );
    }
}

#[test]
fn a_crash_mid_write_leaves_the_previous_checkpoint_loadable() {
    let dir = out("crash");
    run(
        &TrainConfig {
            checkpoint_every: 2,
            stop_after: Some(4),
            ..config(&dir)
        },
        StrategyKind::Fsdp,
        2,
    );
    let good = state::latest(&dir).unwrap();
    assert!(good.ends_with("step_00000004"), "{}", good.display());
    // A crash while writing step 6: a temporary directory with a truncated
    // shard; and one of step 5, as a kill while a stop's checkpoint was
    // written leaves it (no later save of step 5 replaces it).
    let shard = std::fs::read(good.join("rank_0.safetensors")).unwrap();
    for step in [5, 6] {
        let tmp = dir.join(format!("checkpoints/step_{step:08}.tmp"));
        std::fs::create_dir_all(&tmp).unwrap();
        std::fs::write(tmp.join("rank_0.safetensors"), &shard[..shard.len() / 2]).unwrap();
    }
    assert_eq!(state::latest(&dir).unwrap(), good);
    let rest = resume(&dir, StrategyKind::Fsdp, 2);
    assert_eq!(rest.losses.len(), 2);
    assert_eq!(
        state::list(&dir).unwrap().len(),
        3,
        "steps 2, 4 and 6 are kept"
    );
    let names: Vec<_> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.ends_with(".tmp")),
        "a write cut short is removed once a checkpoint is published: {names:?}"
    );
}

#[test]
fn a_flipped_byte_or_a_missing_tensor_is_named() {
    let dir = out("flip");
    run(
        &TrainConfig {
            stop_after: Some(2),
            ..config(&dir)
        },
        StrategyKind::Zero2,
        2,
    );
    let ckpt = state::latest(&dir).unwrap();
    let file = ckpt.join("rank_1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x20;
    std::fs::write(&file, &bytes).unwrap();
    let err = state::load(&ckpt).err().unwrap().to_string();
    assert!(
        err.contains("rank_1.safetensors") && err.contains("corrupted"),
        "{err}"
    );

    // A shard without its "m" tensor whose checksum was updated: refused by name.
    bytes[at] ^= 0x20;
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let keep: Vec<(String, safetensors::tensor::TensorView)> = ["params", "v"]
        .iter()
        .map(|n| (n.to_string(), st.tensor(n).unwrap()))
        .collect();
    let partial = safetensors::serialize(keep, &None).unwrap();
    std::fs::write(&file, &partial).unwrap();
    let index_path = ckpt.join("index.json");
    let mut index: state::Index =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let entry = index
        .files
        .iter_mut()
        .find(|f| f.file == "rank_1.safetensors")
        .unwrap();
    entry.checksum = distgpt::store::checksum(&partial);
    index.checksum = index.compute_checksum();
    std::fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    let err = state::load(&ckpt).err().unwrap().to_string();
    assert!(
        err.contains("rank_1.safetensors") && err.contains("missing tensor 'm'"),
        "{err}"
    );

    // A folder in a rank file's place is said to be one (it was "4096
    // bytes cannot hold ...: the file is truncated").
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    let err = state::load(&ckpt).err().unwrap().to_string();
    assert!(err.contains("rank_1.safetensors is a folder"), "{err}");
}

#[cfg(unix)]
#[test]
fn ctrl_c_finishes_the_step_writes_a_checkpoint_and_exits() {
    let dir = out("sigint");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "100000",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--quiet",
        ])
        .args(["--peak-tflops", "0.1", "--out", dir.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 3 {
        assert!(t0.elapsed() < Wait::from_secs(60), "training did not start");
        std::thread::sleep(Wait::from_millis(50));
    }
    let kill = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(75),
        "a stop is not a finished run: {err}"
    );
    assert!(err.contains("interrupted"), "{err}");
    let ckpt = state::latest(&dir).unwrap();
    let steps_logged = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert_eq!(state::load(&ckpt).unwrap().index.step, steps_logged);
}

#[test]
fn consolidating_a_sharded_checkpoint_gives_the_saved_model() {
    let dir = out("consolidate");
    let bin = env!("CARGO_BIN_EXE_distgpt");
    let run = std::process::Command::new(bin)
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--quiet",
        ])
        .args([
            "--strategy",
            "zero2",
            "--world-size",
            "2",
            "--peak-tflops",
            "0.1",
            "--out",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let file = dir.join("consolidated");
    let cons = std::process::Command::new(bin)
        .args([
            "checkpoint",
            "consolidate",
            dir.to_str().unwrap(),
            "--out",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        cons.status.success(),
        "{}",
        String::from_utf8_lossy(&cons.stderr)
    );
    assert!(
        std::fs::read(file.join("model.safetensors")).unwrap()
            == std::fs::read(dir.join("model.safetensors")).unwrap()
    );
    // With its model.json, the folder is a model that eval and generate read.
    let (model, _) = load_model(Cpu::new(), &file).unwrap();
    assert_eq!(model.config.n_layer, 2);
    // the first release's --out FILE.safetensors (one weights file) still
    // works, with a note; it was refused as "names a file"
    let one = dir.join("consolidated.safetensors");
    let cons = std::process::Command::new(bin)
        .args(["checkpoint", "consolidate", dir.to_str().unwrap()])
        .args(["--out", one.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&cons.stderr);
    assert!(
        cons.status.success() && said.contains("is the old spelling of"),
        "{said}"
    );
    assert!(std::fs::read(&one).unwrap() == std::fs::read(file.join("model.safetensors")).unwrap());
    let left = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name());
    let left: Vec<_> = left
        .filter(|n| n.to_string_lossy().starts_with("consolidated.safetensors."))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
