//! A run is never lost and never silently wrong: each test here guards one
//! way a run was lost or misread (reusing --out, signals, divergence, a
//! closed pipe, a kill between the last files, a slow checkpoint write, an
//! edited index or model file, mismatched data, ignored resume flags, bad
//! numbers).

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

#[path = "support/bert.rs"]
mod bert;

use distgpt::backend::cpu::Cpu;
use distgpt::checkpoint::state;
use distgpt::comm::Comm;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::parallel::{self, launch, OwnedState, ParallelConfig, StepConfig, StrategyKind};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::{load_model, save_model};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_distgpt"))
}

fn tmp(tag: &str) -> PathBuf {
    scratch(&format!("rel-{tag}"))
}

/// `distgpt train` on the tiny model into `out`, with extra flags.
fn train(out: &Path, extra: &[&str]) -> Output {
    bin()
        .args([
            "train",
            "--model",
            "tiny",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
        ])
        .args(["--quiet", "--peak-tflops", "0.1", "--eval-batches", "2"])
        .args(["--out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

/// `distgpt ARGS` on a disk that fills with the first file past `blocks`
/// of 512 bytes: a file-size limit (`ulimit -f`, SIGXFSZ ignored, so a
/// write past it fails with EFBIG as one past a full disk with ENOSPC).
fn on_a_full_disk(blocks: usize, args: &[&str]) -> Output {
    let limit = format!("trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" \"$@\"");
    Command::new("sh")
        .args(["-c", &limit])
        .arg(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .output()
        .unwrap()
}

/// Every file under `dir` but the lock (which names its last holder), with
/// its bytes, in order: what a failed command must leave as it found it.
fn contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            match p.is_dir() {
                true => todo.push(p),
                false if p.ends_with(".lock") => {}
                false => out.push((
                    p.strip_prefix(dir).unwrap().into(),
                    std::fs::read(&p).unwrap(),
                )),
            }
        }
    }
    out.sort();
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn metrics_steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_new_run_into_a_run_directory_is_refused_unless_overwritten() {
    let dir = tmp("reuse");
    assert!(train(&dir, &["--steps", "3"]).status.success());
    let again = train(&dir, &["--steps", "2", "--lr", "1e-2"]);
    assert!(!again.status.success());
    let err = stderr(&again);
    assert!(err.contains("--resume") && err.contains("--out"), "{err}");
    assert_eq!(metrics_steps(&dir), [1, 2, 3], "the old run is untouched");

    let over = train(&dir, &["--steps", "2", "--overwrite"]);
    assert!(over.status.success(), "{}", stderr(&over));
    assert_eq!(metrics_steps(&dir), [1, 2]);
    let kept: Vec<_> = state::list(&dir).unwrap();
    assert_eq!(kept.len(), 1);
    assert!(kept[0].ends_with("step_00000002"));

    // --overwrite never empties a directory that is not a run.
    let other = tmp("not-a-run");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let refused = train(&other, &["--steps", "1", "--overwrite"]);
    assert!(!refused.status.success());
    assert!(other.join("notes.txt").exists());
}

#[test]
fn default_run_directories_are_named_by_date_with_a_latest_link() {
    let cwd = tmp("default-name");
    std::fs::create_dir_all(&cwd).unwrap();
    let run = bin()
        .current_dir(&cwd)
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--batch-size",
            "4",
        ])
        .args(["--seq-len", "16", "--quiet", "--peak-tflops", "0.1"])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", stderr(&run));
    let names: Vec<String> = std::fs::read_dir(cwd.join("runs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let run_name = names.iter().find(|n| n.starts_with("tiny-")).unwrap();
    // tiny-YYYYMMDD-HHMMSS
    let stamp = &run_name["tiny-".len()..];
    assert!(
        stamp.len() == 15 && stamp.as_bytes()[8] == b'-',
        "{run_name}"
    );
    let link = std::fs::read_link(cwd.join("runs/latest")).unwrap();
    assert_eq!(link, Path::new(run_name));
    assert!(cwd.join("runs/latest/model.json").exists());
}

/// Starts a long run and waits until it has logged `steps` steps.
fn start_long_run(dir: &Path, extra: &[&str], steps: usize) -> std::process::Child {
    let child = bin()
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "100000",
            "--batch-size",
            "4",
        ])
        .args(["--seq-len", "32", "--quiet", "--peak-tflops", "0.1"])
        .args(["--out", dir.to_str().unwrap()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let metrics = dir.join("metrics.jsonl");
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < steps {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "training did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

#[cfg(unix)]
#[test]
fn sigterm_and_a_double_sigint_stop_with_a_checkpoint_and_status_75() {
    for (tag, signals) in [("term", &["TERM"][..]), ("int-int", &["INT", "INT"][..])] {
        let dir = tmp(tag);
        let child = start_long_run(&dir, &[], 3);
        for s in signals {
            signal(child.id(), s);
        }
        let out = child.wait_with_output().unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(75), "{tag}: {err}");
        let ckpt = state::latest(&dir).unwrap();
        let logged = metrics_steps(&dir);
        assert_eq!(
            state::load(&ckpt).unwrap().index.step as u64,
            *logged.last().unwrap(),
            "{tag}"
        );
        distgpt::model::files::read_model_files(&dir).unwrap();
    }
}

/// A stop checkpoints and exits within a step: it neither evaluates (a
/// validation pass of a million batches is asked for here) nor samples
/// (65,536 tokens), which a normal end does; the closing line says the run
/// has no validation figure yet.
#[cfg(unix)]
#[test]
fn a_stop_checkpoints_without_evaluating_or_sampling() {
    let dir = tmp("quick-stop");
    let slow_end = ["--eval-batches", "1000000", "--sample-tokens", "65536"];
    let child = start_long_run(&dir, &slow_end, 3);
    let t0 = Instant::now();
    signal(child.id(), "TERM");
    let out = child.wait_with_output().unwrap();
    let waited = t0.elapsed();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(waited < Duration::from_secs(30), "stopped in {waited:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("| not evaluated yet |"), "{said}");
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert!(last["val_loss"].is_null(), "{last}");
    let ckpt = state::latest(&dir).unwrap();
    assert_eq!(
        state::load(&ckpt).unwrap().index.step as u64,
        last["step"].as_u64().unwrap()
    );
}

/// Two processes on one run directory: while a run trains, a second
/// `--resume` of it (and a new run with `--overwrite` into it) is refused
/// naming the holder's pid, and leaves the live run's files alone; after
/// the holder stops, the resume goes ahead.
#[cfg(unix)]
#[test]
fn a_run_directory_in_use_is_refused_naming_the_holder() {
    let dir = tmp("locked");
    let child = start_long_run(&dir, &["--checkpoint-every", "2"], 3);
    while state::latest(&dir).is_err() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let record = std::fs::read_to_string(dir.join("run.json")).unwrap();
    let pid = child.id().to_string();
    for args in [
        vec!["train", "--resume", dir.to_str().unwrap(), "--quiet"],
        vec![
            "train",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--overwrite",
            "--quiet",
            "--out",
            dir.to_str().unwrap(),
        ],
    ] {
        let out = bin().args(&args).output().unwrap();
        let err = stderr(&out);
        assert!(
            !out.status.success() && err.contains("is in use") && err.contains(&pid),
            "{args:?}: {err}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("run.json")).unwrap(),
        record
    );
    assert!(dir.join("metrics.jsonl").exists());
    signal(child.id(), "TERM");
    assert_eq!(child.wait_with_output().unwrap().status.code(), Some(75));
    let at = state::step_of(&state::latest(&dir).unwrap()).unwrap();
    let to = (at + 2).to_string();
    let resumed = bin()
        .args([
            "train",
            "--resume",
            dir.to_str().unwrap(),
            "--steps",
            &to,
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));
}

/// A resume takes the run's lock before it reads any of the run's files
/// and holds it until the run's outputs take it over: while another
/// process holds the run (this test, standing in for a training process
/// midway through setting its checkpoints aside), a resume is refused as
/// in use, never for what it read of checkpoints changing under it (it
/// listed them first: "no complete checkpoint", or a checkpoint's
/// index.json not found when it lost the race). Released, it resumes,
/// from a checkpoint named from inside the run too.
#[test]
fn a_resume_reads_a_run_only_once_it_holds_the_runs_lock() {
    let dir = tmp("lock-first");
    let out = train(&dir, &["--steps", "2", "--checkpoint-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let aside = dir.join("aside");
    std::fs::rename(dir.join("checkpoints"), &aside).unwrap();
    let held = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join(".lock"))
        .unwrap();
    held.try_lock().unwrap();
    let ckpt = dir.join("checkpoints").join("step_00000002");
    for resume in [
        vec![dir.to_str().unwrap(), "--steps", "3"],
        vec![dir.to_str().unwrap(), "--from-step", "1", "--steps", "3"],
    ] {
        let out = bin()
            .arg("train")
            .arg("--resume")
            .args(&resume)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert!(
            !out.status.success() && err.contains("is in use"),
            "{resume:?}: {err}"
        );
    }
    drop(held);
    std::fs::rename(&aside, dir.join("checkpoints")).unwrap();
    assert!(ckpt.join("index.json").exists());
    // a checkpoint named from inside its run (whose run is "")
    let out = bin()
        .current_dir(&dir)
        .args(["train", "--resume", "checkpoints/step_00000002"])
        .args(["--steps", "3", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(metrics_steps(&dir), [1, 2, 3]);
}

/// A folder that holds no run, given to `--resume`, is said to hold no
/// checkpoint and is left as it was: no lock file is made in it (a later
/// `--out` there would find it "already holding" the lock).
#[test]
fn a_resume_of_a_folder_without_a_run_writes_nothing_into_it() {
    let dir = tmp("resume-no-run");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a run").unwrap();
    let out = bin()
        .args(["train", "--resume", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("no complete checkpoint"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["notes.txt"], "in {}", dir.display());
}

#[test]
fn a_diverging_step_is_not_applied_and_never_checkpointed() {
    // The strategy refuses the update itself: the weights stay finite.
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = 65;
    let par = ParallelConfig {
        strategy: StrategyKind::Single,
        world_size: 1,
        tp: 1,
        recompute: false,
        precision: Default::default(),
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    };
    let (_, mut comms) = distgpt::comm::local::world(1, Duration::from_secs(10));
    let comm = comms.pop().unwrap();
    let mut s = parallel::build(
        Cpu::new(),
        cfg.clone(),
        par,
        &comm,
        Default::default(),
        2,
        8,
    )
    .unwrap();
    let mut init = distgpt::model::gpt2::init_full(&cfg, 1);
    let ln_f = init.len() - 1;
    init[ln_f] = f32::INFINITY; // ln_f bias: the logits, the loss and the gradients go non-finite
    s.load_full(&init).unwrap();
    let batch = distgpt::data::Batch::lm(vec![1; 16], vec![2; 16]);
    let before = s.full_params().unwrap();
    let err = s
        .step(
            &[batch],
            StepConfig {
                lr: 1e-3,
                grad_clip: 1.0,
            },
        )
        .unwrap_err();
    assert!(matches!(err, distgpt::error::Error::Diverged(_)), "{err}");
    let after = s.full_params().unwrap();
    assert!(
        before
            .iter()
            .zip(&after)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the update was applied"
    );

    // A non-finite state is never published as a checkpoint.
    let dir = tmp("nan-save");
    let owned = OwnedState {
        segments: vec![(0, 3)],
        params: vec![1.0, f32::NAN, 2.0],
        m: vec![0.0; 3],
        v: vec![0.0; 3],
    };
    let info = state::SaveInfo {
        step: 1,
        adam_step: 1,
        loader: Default::default(),
        strategy: "single",
        tp: 1,
        params_total: 3,
        model: &cfg.clone().into(),
        tokenizer: &distgpt::data::TokenizerSpec::Gpt2,
        labels: &[],
        data: "x",
        keep: 3,
        extra: None,
    };
    let err = state::save(&dir, &info, &owned, &comm)
        .unwrap_err()
        .to_string();
    assert!(err.contains("non-finite"), "{err}");
    assert!(state::list(&dir).unwrap().is_empty());

    // End to end: the run stops, names the last good checkpoint, and it loads.
    let dir = tmp("diverge");
    let out = train(&dir, &["--steps", "10", "--lr", "1e30", "--warmup", "0"]);
    let err = stderr(&out);
    assert!(!out.status.success() && err.contains("diverged"), "{err}");
    let dir2 = tmp("diverge-ckpt");
    let out = train(
        &dir2,
        &[
            "--steps",
            "10",
            "--lr",
            "1e30",
            "--warmup",
            "0",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "1",
        ],
    );
    // the one checkpoint kept holds the weights that gave the NaN: it is
    // not offered (resumed, it replays the same batch on them)
    let err = stderr(&out);
    assert!(
        err.contains("The checkpoint of step 1 holds the weights that gave these numbers")
            && err.contains("No checkpoint of an earlier step is kept: start again")
            && !err.contains("--from-step"),
        "{err}"
    );
    state::load(&state::latest(&dir2).unwrap()).unwrap();
}

/// A divergence's hint resumes: checkpoints after steps 1 to 3 at a sane
/// rate, then steps at 1e10, whose step 5 is not finite from step 4's
/// weights: the hint names step 3, and running it trains on. It named the
/// newest, step 4, whose resume failed again word for word. And a last
/// update that leaves weights scoring no finite loss stops the run before
/// its model files and checkpoint are written: the run exited 0 with a
/// NaN validation loss, a checkpoint and model files of those weights.
#[test]
fn a_divergences_hint_resumes_and_a_diverged_last_update_writes_no_model() {
    let dir = tmp("diverge-hint");
    let every = ["--checkpoint-every", "1", "--keep-checkpoints", "9"];
    assert!(train(
        &dir,
        &[&["--steps", "3", "--warmup", "0"], &every[..]].concat()
    )
    .status
    .success());
    let resume = |extra: &[&str]| {
        bin()
            .args(["train", "--quiet", "--resume", dir.to_str().unwrap()])
            .args(["--steps", "6"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = resume(&["--lr", "1e10", "--min-lr", "1e10"]);
    let err = stderr(&out);
    let hint = err
        .split("--from-step ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no --from-step in the hint: {err}"));
    assert!(
        !out.status.success() && err.contains("step 5: loss NaN") && hint == "3",
        "{err}"
    );
    let out = resume(&["--from-step", hint, "--lr", "1e-3"]);
    assert!(out.status.success(), "the hint's resume: {}", stderr(&out));

    let last = tmp("diverge-last");
    let out = train(
        &last,
        &[
            &["--steps", "1", "--warmup", "0", "--lr", "1e10"],
            &every[..],
        ]
        .concat(),
    );
    let err = stderr(&out);
    assert!(
        !out.status.success()
            && err.contains("step 1: the validation loss after its update is NaN"),
        "{err}"
    );
    assert!(!last.join("model.safetensors").exists() && state::list(&last).unwrap().is_empty());
}

#[test]
fn resume_from_an_older_checkpoint_supersedes_the_newer_ones() {
    let whole = tmp("from-whole");
    assert!(train(&whole, &["--steps", "4"]).status.success());
    let dir = tmp("from-step");
    assert!(train(
        &dir,
        &[
            "--steps",
            "4",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "9"
        ]
    )
    .status
    .success());
    let again = bin()
        .args([
            "train",
            "--resume",
            dir.to_str().unwrap(),
            "--from-step",
            "2",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(metrics_steps(&dir), [1, 2, 3, 4], "no step is logged twice");
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    let csv_steps: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(csv_steps, ["1", "2", "3", "4"], "{csv}");
    assert!(dir.join("checkpoints/superseded/step_00000004").exists());
    assert!(
        std::fs::read(dir.join("model.safetensors")).unwrap()
            == std::fs::read(whole.join("model.safetensors")).unwrap()
    );
    let record = distgpt::train::run_dir::read_record(&dir).unwrap();
    let starts: Vec<usize> = record.segments.iter().map(|s| s.from_step).collect();
    assert_eq!(starts, [0, 2]);
    // a checkpoint set aside is named so, with the command that recovers
    // it (it was told of "no run.json" and a consolidate that fails)
    let aside = dir.join("checkpoints/superseded/step_00000004");
    let o = bin()
        .args(["train", "--resume", aside.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && stderr(&o).contains("was set aside when its run resumed"),
        "{}",
        stderr(&o)
    );
    let out = dir.join("recovered");
    let recovered = bin()
        .args(["checkpoint", "consolidate", aside.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(recovered.status.success(), "{}", stderr(&recovered));
}

#[test]
fn a_closed_stdout_does_not_lose_the_run() {
    let dir = tmp("pipe");
    let mut child = bin()
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "5",
            "--batch-size",
            "4",
        ])
        .args(["--seq-len", "32", "--quiet", "--peak-tflops", "0.1"])
        .args(["--out", dir.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // like `| head` exiting at once
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    distgpt::model::files::read_model_files(&dir).unwrap();
}

#[test]
fn a_run_killed_before_its_model_files_is_repaired_by_resume() {
    let dir = tmp("repair");
    assert!(train(&dir, &["--steps", "3"]).status.success());
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.join("model.json")).unwrap();
    assert!(distgpt::model::files::read_model_files(&dir).is_err());
    let resumed = bin()
        .args(["train", "--resume", dir.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    distgpt::model::files::read_model_files(&dir).unwrap();
    assert!(std::fs::read(dir.join("model.safetensors")).unwrap() == weights);
    // A finished run with readable files says so and how to extend it.
    let again = bin()
        .args(["train", "--resume", dir.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--steps"), "{}", stderr(&again));
}

#[test]
fn waiting_for_a_slow_checkpoint_write_is_not_a_dead_rank() {
    let cfg = GptConfig::preset("tiny").unwrap();
    let dir = tmp("slow-write");
    // Rank 0 owns 8M floats (96 MB to checksum and write); rank 1 owns
    // nothing and waits far longer than the 50 ms collective timeout.
    let n = 8 << 20;
    launch::run_local(2, 2, Duration::from_millis(50), |comm: Box<dyn Comm>| {
        let owned = if comm.rank() == 0 {
            OwnedState {
                segments: vec![(0, n)],
                params: vec![0.5; n],
                m: vec![0.0; n],
                v: vec![0.0; n],
            }
        } else {
            OwnedState::default()
        };
        let info = state::SaveInfo {
            step: 1,
            adam_step: 1,
            loader: Default::default(),
            strategy: "zero1",
            tp: 1,
            params_total: n,
            model: &cfg.clone().into(),
            tokenizer: &distgpt::data::TokenizerSpec::Gpt2,
            labels: &[],
            data: "x",
            keep: 1,
            extra: None,
        };
        state::save(&dir, &info, &owned, comm.as_ref()).map(|_| ())
    })
    .unwrap();
    assert_eq!(state::list(&dir).unwrap().len(), 1);
}

/// A finished zero2 run on two ranks, for the index and model-file tests.
fn finished_run(tag: &str) -> PathBuf {
    let dir = tmp(tag);
    let out = train(
        &dir,
        &["--steps", "2", "--strategy", "zero2", "--world-size", "2"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    dir
}

fn edit_index(ckpt: &Path, edit: impl FnOnce(&mut state::Index), reseal: bool) {
    let path = ckpt.join("index.json");
    let mut index: state::Index =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut index);
    if reseal {
        index.checksum = index.compute_checksum();
    }
    std::fs::write(&path, serde_json::to_string_pretty(&index).unwrap()).unwrap();
}

#[test]
fn an_edited_or_crafted_checkpoint_index_is_refused_without_panicking() {
    let dir = finished_run("index");
    let ckpt = state::latest(&dir).unwrap();
    let original = std::fs::read(ckpt.join("index.json")).unwrap();
    type Edit = Box<dyn Fn(&mut state::Index)>;
    let cases: Vec<(&str, Edit, bool, &str)> = vec![
        ("step", Box::new(|i| i.step += 1), false, "checksum"),
        (
            "overlap",
            Box::new(|i| i.files[1].segments[0].0 -= 1),
            true,
            "overlaps",
        ),
        (
            "offset",
            Box::new(|i| i.files[1].segments[0].0 = usize::MAX - 3),
            true,
            "outside",
        ),
        (
            "huge model",
            Box::new(|i| {
                let mut c = i.model.gpt2().expect("a GPT-2 run").clone();
                c.n_layer = 1 << 40;
                i.model = c.into();
            }),
            true,
            "parameters",
        ),
        (
            "path",
            Box::new(|i| i.files[0].file = "../../model.safetensors".into()),
            true,
            "not a rank file",
        ),
    ];
    for (what, edit, reseal, expect) in cases {
        std::fs::write(ckpt.join("index.json"), &original).unwrap();
        edit_index(&ckpt, edit, reseal);
        let err = std::panic::catch_unwind(|| state::load(&ckpt).err())
            .unwrap_or_else(|_| panic!("{what}: load panicked"))
            .unwrap_or_else(|| panic!("{what}: an edited index was accepted"))
            .to_string();
        assert!(
            err.contains(expect) && err.contains("index.json"),
            "{what}: {err}"
        );
    }
}

#[test]
fn edited_model_files_and_non_finite_weights_are_refused() {
    let dir = finished_run("model-files");
    load_model(Cpu::new(), &dir).unwrap();
    let weights = dir.join("model.safetensors");
    let meta = dir.join("model.json");
    let (w0, m0) = (
        std::fs::read(&weights).unwrap(),
        std::fs::read(&meta).unwrap(),
    );
    let restore = || {
        std::fs::write(&weights, &w0).unwrap();
        std::fs::write(&meta, &m0).unwrap();
    };

    let mut flipped = w0.clone();
    let at = flipped.len() - 5;
    flipped[at] ^= 0x01;
    std::fs::write(&weights, &flipped).unwrap();
    let err = load_model(Cpu::new(), &dir).err().unwrap().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("checksum"),
        "{err}"
    );
    restore();

    let json = String::from_utf8(m0.clone()).unwrap();
    std::fs::write(&meta, json.replace("\"n_head\": 2", "\"n_head\": 1")).unwrap();
    let err = load_model(Cpu::new(), &dir).err().unwrap().to_string();
    assert!(
        err.contains("model.json") && err.contains("edited"),
        "{err}"
    );
    restore();

    // A crafted model.json (checksum recomputed by hand) asking for a
    // billion layers is refused before anything that size is allocated.
    let mut v: serde_json::Value = serde_json::from_slice(&m0).unwrap();
    v["config"]["n_layer"] = 1_000_000_000u64.into();
    v["checksum"] = "".into();
    let sum = distgpt::store::checksum(serde_json::to_string_pretty(&v).unwrap().as_bytes());
    v["checksum"] = sum.into();
    std::fs::write(&meta, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let err = load_model(Cpu::new(), &dir).err().unwrap().to_string();
    assert!(
        err.contains("parameters") || err.contains("cannot hold"),
        "{err}"
    );
    restore();

    // Weights saved with a NaN (model.json vouching for them) are still refused.
    let (mut model, meta_v) = load_model(Cpu::new(), &dir).unwrap();
    let mut p = model.params_host().unwrap();
    p[7] = f32::NAN;
    model.set_params(&p).unwrap();
    let nan_dir = tmp("nan-model");
    save_model(&model, meta_v.tokenizer, &nan_dir).unwrap();
    let err = load_model(Cpu::new(), &nan_dir).err().unwrap().to_string();
    assert!(err.contains("non-finite"), "{err}");
}

#[test]
fn every_shard_token_is_checked_and_data_must_match_the_model() {
    // A bad token at the very end of a shard (never a sampled position).
    let shards = tmp("bad-token");
    distgpt::data::prepare(None, TokenizerKind::Char, &shards).unwrap();
    let val = std::fs::read_dir(&shards)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("_val_"))
        .unwrap();
    let mut bytes = std::fs::read(&val).unwrap();
    let n = bytes.len();
    bytes[n - 2..].copy_from_slice(&200u16.to_le_bytes());
    std::fs::write(&val, &bytes).unwrap();
    let err = Dataset::load(Some(&shards), TokenizerKind::Char)
        .err()
        .unwrap()
        .to_string();
    let last = (n - 1024) / 2 - 1;
    assert!(
        err.contains("_val_") && err.contains(&format!("position {last}")),
        "{err}"
    );

    // A character model evaluated on GPT-2 shards.
    let model_dir = finished_run("tokenizer");
    let gpt2 = tmp("gpt2-shards");
    distgpt::data::prepare(None, TokenizerKind::Gpt2, &gpt2).unwrap();
    let eval = bin()
        .args([
            "eval",
            model_dir.to_str().unwrap(),
            "--data",
            gpt2.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!eval.status.success());
    assert!(
        stderr(&eval).contains("tokenized with GPT-2"),
        "{}",
        stderr(&eval)
    );
    // (no --model: a run from a model folder takes the folder's)
    let tune = bin()
        .args(["train", "--init-from", model_dir.to_str().unwrap()])
        .args(["--data", gpt2.to_str().unwrap(), "--steps", "1"])
        .args(["--batch-size", "4", "--seq-len", "32", "--quiet"])
        .args(["--out", tmp("tune").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!tune.status.success());
    assert!(
        stderr(&tune).contains("tokenized with GPT-2"),
        "{}",
        stderr(&tune)
    );

    // Resuming on changed data.
    let text = tmp("text");
    std::fs::create_dir_all(&text).unwrap();
    let file = text.join("corpus.txt");
    std::fs::write(&file, &distgpt::data::SHAKESPEARE[..200_000]).unwrap();
    let dir = tmp("changed-data");
    let run = train(
        &dir,
        &[
            "--data",
            file.to_str().unwrap(),
            "--steps",
            "4",
            "--stop-after",
            "2",
        ],
    );
    assert_eq!(run.status.code(), Some(75), "{}", stderr(&run));
    std::fs::write(&file, &distgpt::data::SHAKESPEARE[1_000..201_000]).unwrap();
    let resumed = bin()
        .args(["train", "--resume", dir.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    assert!(!resumed.status.success());
    assert!(
        stderr(&resumed).contains("other data"),
        "{}",
        stderr(&resumed)
    );

    // The same for a masked LM (its checkpoint records its data's
    // fingerprint), and its val split too short to evaluate on is refused
    // before a step is trained.
    let mlm = |out: &Path, data: &Path, extra: &[&str]| {
        bin()
            .args(["train", "--task", "mlm", "--model", "bert-tiny"])
            .args(["--batch-size", "4", "--seq-len", "32", "--quiet"])
            .args(["--peak-tflops", "0.1", "--data", data.to_str().unwrap()])
            .args(["--out", out.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let dir = tmp("changed-data-mlm");
    let run = mlm(&dir, &file, &["--steps", "4", "--stop-after", "2"]);
    assert_eq!(run.status.code(), Some(75), "{}", stderr(&run));
    std::fs::write(&file, &distgpt::data::SHAKESPEARE[..200_000]).unwrap();
    let resumed = bin()
        .args(["train", "--resume", dir.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    assert!(
        !resumed.status.success() && stderr(&resumed).contains("other data"),
        "{}",
        stderr(&resumed)
    );
    let short = text.join("short.txt");
    std::fs::write(&short, &distgpt::data::SHAKESPEARE[..300]).unwrap();
    let dir = tmp("short-val-mlm");
    let refused = mlm(&dir, &short, &["--steps", "2"]);
    assert!(
        !refused.status.success() && stderr(&refused).contains("the val split has"),
        "{}",
        stderr(&refused)
    );
    assert!(!dir.join("metrics.jsonl").exists(), "a step was trained");
}

#[test]
fn resume_flags_are_honoured_or_refused_and_a_finished_run_extends() {
    let dir = tmp("extend");
    assert!(
        train(&dir, &["--steps", "4", "--warmup", "1", "--lr", "1e-2"])
            .status
            .success()
    );
    for (flag, value) in [
        ("--batch-size", "8"),
        ("--model", "gpt2"),
        ("--seed", "3"),
        ("--warmup", "2"),
    ] {
        let out = bin()
            .args([
                "train",
                "--resume",
                dir.to_str().unwrap(),
                flag,
                value,
                "--quiet",
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} was accepted");
        let err = stderr(&out);
        assert!(err.contains(flag) && err.contains("cannot change"), "{err}");
    }
    let more = bin()
        .args(["train", "--resume", dir.to_str().unwrap(), "--steps", "7"])
        .args([
            "--eval-every",
            "1",
            "--strategy",
            "ddp",
            "--world-size",
            "2",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(more.status.success(), "{}", stderr(&more));
    assert_eq!(metrics_steps(&dir), [1, 2, 3, 4, 5, 6, 7]);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The schedule ended at step 4: later steps run at min_lr (lr / 10); every one is evaluated.
    for l in &lines[4..] {
        assert!((l["lr"].as_f64().unwrap() - 1e-3).abs() < 1e-9, "{l}");
        assert!(l["val_loss"].is_number(), "{l}");
    }
    let record = distgpt::train::run_dir::read_record(&dir).unwrap();
    assert_eq!(record.segments.len(), 2);
    assert_eq!(record.segments[1].parallel.strategy, StrategyKind::Ddp);
    assert_eq!(record.segments[1].parallel.world_size, 2);
    assert_eq!(
        (record.segments[1].from_step, record.segments[1].to_step),
        (4, 7)
    );
}

#[test]
fn bad_numbers_are_refused_with_the_flag_named() {
    let dir = tmp("bad-numbers");
    let cases: [(&[&str], &str); 9] = [
        (&["--lr=-1e-3"], "--lr"),
        (&["--grad-clip", "NaN"], "--grad-clip"),
        (&["--beta1", "NaN"], "--beta1"),
        (&["--weight-decay", "inf"], "--weight-decay"),
        (&["--steps", "0"], "--steps"),
        (&["--epochs", "0"], "--epochs"),
        (&["--epochs", "NaN"], "--epochs"),
        (&["--steps", "1000000000000"], "--steps"),
        (&["--keep-checkpoints", "0"], "--keep-checkpoints"),
    ];
    for (args, flag) in cases {
        let out = train(&dir, args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(
            err.contains(flag) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    let huge = bin()
        .args([
            "train",
            "--model",
            "gpt2",
            "--strategy",
            "ddp",
            "--world-size",
            "1000",
        ])
        .args(["--batch-size", "1000", "--seq-len", "64", "--quiet"])
        .args(["--out", dir.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr(&huge);
    assert!(err.contains("1000 thread ranks need"), "{err}");

    let model = finished_run("sampling");
    for (flag, value) in [
        ("--top-p", "1.5"),
        ("--temperature", "-1"),
        ("--top-p", "0"),
    ] {
        let out = bin()
            .args(["generate", model.to_str().unwrap(), "--tokens", "3"])
            .arg(format!("{flag}={value}"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} was accepted");
        assert!(stderr(&out).contains(flag), "{}", stderr(&out));
    }
    let bench = bin()
        .args([
            "bench",
            "--model",
            "tiny",
            "--generate",
            "65",
            "--batch-size",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!bench.status.success());
    let err = stderr(&bench);
    assert!(
        err.contains("--generate 65") && !err.contains("panicked"),
        "{err}"
    );
}

/// Under mpirun, a signal to mpirun alone stops every rank at the same step
/// with a checkpoint: SIGINT (which Open MPI turns into SIGTERM to the ranks)
/// and SIGUSR2 (which it forwards; Open MPI 4.1's mpirun was seen not to
/// forward SIGUSR1).
#[cfg(feature = "mpi")]
#[test]
fn a_signal_to_mpirun_stops_every_rank_with_a_checkpoint() {
    for sig in ["INT", "USR2"] {
        let dir = tmp(&format!("mpirun-{sig}"));
        let child = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
            .arg(env!("CARGO_BIN_EXE_distgpt"))
            .args([
                "train",
                "--comm",
                "mpi",
                "--strategy",
                "ddp",
                "--world-size",
                "2",
            ])
            .args(["--model", "tiny", "--steps", "100000", "--batch-size", "4"])
            .args(["--seq-len", "32", "--quiet", "--peak-tflops", "0.1"])
            .args(["--out", dir.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |s| s.lines().count())
            < 3
        {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "training did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        signal(child.id(), sig);
        let out = child.wait_with_output().unwrap();
        let err = stderr(&out);
        assert_eq!(
            err.matches("interrupted: finishing the step").count(),
            2,
            "SIG{sig}: both ranks must hear of it: {err}"
        );
        let ckpt = state::latest(&dir).unwrap();
        let logged = metrics_steps(&dir);
        assert_eq!(
            state::load(&ckpt).unwrap().index.step as u64,
            *logged.last().unwrap(),
            "SIG{sig}: {err}"
        );
        distgpt::model::files::read_model_files(&dir).unwrap();
    }
}

/// A run.json repeated from another directory trains on the run's own
/// data: the path is recorded absolute, an older record's relative one is
/// found beside the run, and data that changed since is refused by its
/// fingerprint, as a resume refuses it.
#[test]
fn a_run_repeated_by_its_run_json_from_elsewhere_trains_on_its_own_data() {
    let dir = tmp("config-elsewhere");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::create_dir_all(elsewhere.join("data")).unwrap();
    let words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog"];
    let text = |n: usize, k: usize| -> String {
        (0..n)
            .map(|i| words[(i * k + i / 7) % 8])
            .collect::<Vec<_>>()
            .join(" ")
    };
    std::fs::write(dir.join("data/a.txt"), text(3000, 3)).unwrap();
    // another file by the same relative name in the other directory
    std::fs::write(elsewhere.join("data/a.txt"), text(2000, 5)).unwrap();
    let run = |cwd: &Path, args: &[&str]| {
        bin()
            .current_dir(cwd)
            .args(args)
            .args(["--quiet", "--peak-tflops", "0.1"])
            .output()
            .unwrap()
    };
    let args = [
        "train",
        "--model",
        "tiny",
        "--data",
        "data/a.txt",
        "--steps",
        "2",
    ];
    let shape = ["--batch-size", "4", "--seq-len", "32", "--out", "run"];
    let first = run(&dir, &[&args[..], &shape[..]].concat());
    assert!(first.status.success(), "{}", stderr(&first));
    let recorded = |run: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(run.join("run.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["train"]["data"].clone()
    };
    let own = std::fs::canonicalize(dir.join("data/a.txt")).unwrap();
    assert_eq!(
        recorded(&dir.join("run")),
        own.to_str().unwrap(),
        "recorded absolute"
    );
    // a record written before paths were absolute
    let path = dir.join("run/run.json");
    let old = std::fs::read_to_string(&path)
        .unwrap()
        .replace(own.to_str().unwrap(), "data/a.txt");
    std::fs::write(&path, old).unwrap();
    let repeated = run(
        &elsewhere,
        &["train", "--config", "../run/run.json", "--out", "../again"],
    );
    assert!(repeated.status.success(), "{}", stderr(&repeated));
    assert_eq!(recorded(&dir.join("again")), own.to_str().unwrap());
    // the run's data changed since: refused by its fingerprint
    std::fs::write(dir.join("data/a.txt"), text(3000, 5)).unwrap();
    let refused = run(
        &elsewhere,
        &["train", "--config", "../run/run.json", "--out", "../third"],
    );
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("other data"),
        "{}",
        stderr(&refused)
    );
    assert!(!dir.join("third").exists());
}

/// A run killed while it wrote its only checkpoint has nothing to resume:
/// `--resume` says how to start it again, and a new run with its `--out`
/// takes its place without --overwrite, saying what it found.
#[test]
fn a_run_stopped_before_its_first_checkpoint_starts_again_in_its_place() {
    let out = tmp("no-complete-checkpoint");
    let first = train(&out, &["--steps", "1"]);
    assert!(first.status.success(), "{}", stderr(&first));
    // as a kill during the first checkpoint's write leaves it
    std::fs::remove_dir_all(out.join("checkpoints")).unwrap();
    std::fs::create_dir_all(out.join("checkpoints/step_00000001.tmp")).unwrap();
    std::fs::remove_file(out.join("model.safetensors")).unwrap();
    let resumed = bin()
        .args(["train", "--resume", out.to_str().unwrap(), "--quiet"])
        .output()
        .unwrap();
    assert!(!resumed.status.success());
    assert!(
        stderr(&resumed).contains("start it again"),
        "{}",
        stderr(&resumed)
    );
    let again = train(&out, &["--steps", "1"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("in its place"),
        "{}",
        stderr(&again)
    );
    assert_eq!(state::list(&out).unwrap().len(), 1);
    // a run with a complete checkpoint is still refused
    let refused = train(&out, &["--steps", "1"]);
    assert!(
        stderr(&refused).contains("--resume"),
        "{}",
        stderr(&refused)
    );
}

/// The run in `dir` as a kill before its first checkpoint leaves it: no
/// checkpoint and no model weights.
fn as_if_stopped_before_its_first_checkpoint(dir: &Path) {
    std::fs::remove_dir_all(dir.join("checkpoints")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
}

/// A folder of another tool's files is no run, even with a `checkpoints/`
/// or a `metrics.jsonl` in it: `--out` it is refused and nothing in it
/// goes, with `--overwrite` too (both emptied it: the names alone counted
/// as a run, and one stopped before its first checkpoint was replaced
/// without a word). A stopped run beside files of the user's is refused
/// without `--overwrite`, naming them.
#[test]
fn a_folder_of_other_files_is_never_emptied_for_a_run() {
    let files = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    for (tag, own) in [
        ("ckpts", "checkpoints/epoch_10.pt"),
        ("metrics", "metrics.jsonl"),
    ] {
        let dir = tmp(&format!("foreign-{tag}"));
        std::fs::create_dir_all(dir.join("checkpoints")).unwrap();
        std::fs::write(dir.join(own), "theirs").unwrap();
        std::fs::write(dir.join("README.md"), "mine").unwrap();
        let before = files(&dir);
        for extra in [&[][..], &["--overwrite"][..]] {
            let o = train(&dir, &[&["--steps", "1"][..], extra].concat());
            assert!(!o.status.success(), "{tag} {extra:?} trained");
            assert!(stderr(&o).contains("holds no run"), "{}", stderr(&o));
            assert_eq!(files(&dir), before, "{tag} {extra:?}");
            assert_eq!(std::fs::read_to_string(dir.join(own)).unwrap(), "theirs");
        }
    }
    // a run stopped before its first checkpoint, and the user's notes beside it
    let dir = tmp("foreign-beside-a-run");
    assert!(train(&dir, &["--steps", "1"]).status.success());
    as_if_stopped_before_its_first_checkpoint(&dir);
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let o = train(&dir, &["--steps", "1"]);
    assert!(
        !o.status.success()
            && stderr(&o).contains("holds a run stopped before its first checkpoint, and 1 item no run writes (notes.txt)"),
        "{}",
        stderr(&o)
    );
    assert!(dir.join("notes.txt").exists());
    let o = train(&dir, &["--steps", "1", "--overwrite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dir.join("notes.txt").exists());
    // TensorBoard's event files are the run's own, in its folder or in one
    // of theirs, named by --tensorboard or not when it starts again
    for (tag, tb) in [("own", ""), ("sub", "tb")] {
        let dir = tmp(&format!("stopped-with-tensorboard-{tag}"));
        let events = dir.join(tb);
        let first = train(
            &dir,
            &["--steps", "1", "--tensorboard", events.to_str().unwrap()],
        );
        assert!(first.status.success(), "{}", stderr(&first));
        as_if_stopped_before_its_first_checkpoint(&dir);
        let again = train(&dir, &["--steps", "1"]);
        assert!(
            stderr(&again).contains("in its place"),
            "{tag}: {}",
            stderr(&again)
        );
    }
}

/// A newer checkpoint that lost its index is passed over with a warning
/// naming it (the resume went back two steps without a word).
#[test]
fn a_resume_past_a_damaged_checkpoint_names_it() {
    let dir = tmp("damaged-newest");
    let first = train(&dir, &["--steps", "4", "--checkpoint-every", "2"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let newest = dir.join("checkpoints/step_00000004");
    std::fs::remove_file(newest.join("index.json")).unwrap();
    let resumed = bin()
        .args([
            "train",
            "--resume",
            dir.to_str().unwrap(),
            "--steps",
            "5",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let said = stderr(&resumed);
    assert!(
        said.contains(&format!(
            "warning: {} has no index.json (damaged): resuming from",
            newest.display()
        )) && said.contains("step_00000002, whose later steps are trained again"),
        "{said}"
    );
}

/// A resumed run that dies before it writes its model files is read from
/// its newest checkpoint, not from the files of the model it was resumed
/// past: `eval`, `export` and `--init-from` read the finished run's old
/// step-4 model without a word while checkpoints up to step 6 stood beside it.
#[test]
fn a_resume_that_dies_is_read_from_its_newest_checkpoint() {
    let dir = tmp("resume-dies");
    let first = train(&dir, &["--steps", "4", "--checkpoint-every", "2"]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(dir.join("model.safetensors").exists());
    let died = bin()
        .args([
            "train",
            "--resume",
            dir.to_str().unwrap(),
            "--steps",
            "8",
            "--quiet",
        ])
        .args(["--fail-rank", "0", "--fail-step", "6"])
        .output()
        .unwrap();
    assert!(!died.status.success(), "{}", stderr(&died));
    assert!(dir.join("checkpoints/step_00000006").exists());
    let loss = |path: &Path| {
        let o = bin()
            .args([
                "eval",
                path.to_str().unwrap(),
                "--batch-size",
                "4",
                "--batches",
                "2",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let said = String::from_utf8_lossy(&o.stdout).into_owned();
        said.split_once(": val loss").unwrap().1.to_string()
    };
    assert_eq!(loss(&dir), loss(&dir.join("checkpoints/step_00000006")));
    assert_ne!(loss(&dir), loss(&dir.join("checkpoints/step_00000004")));
}

/// Waits (a minute at most) until `ready` says so, naming `what` if not.
fn wait_until(what: &str, ready: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !ready() {
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A classifier signalled while it scores: the record beside the model is
/// of that model or absent. A finished run (scored at 2 steps) extended to
/// 8 and stopped by SIGTERM as it scores step 4's validation split keeps no
/// classify.json of the earlier model, and --resume (from a checkpoint
/// that records the set as the release before did) scores the new one; a
/// SIGTERM while it scores the test split at the end lets it finish, its
/// classify.json the model on disk's (what eval says of it). Both end on
/// the uninterrupted run's figures.
#[cfg(unix)]
#[test]
fn a_classifier_signalled_while_it_scores_keeps_no_record_of_another_model() {
    let dir = tmp("classify-term");
    let (model, data) = bert::tiny_bert_and_labelled_set(&dir);
    // 4 training examples: a step an epoch, each epoch scored on 4,000
    for (split, n) in [("train", 4), ("val", 4000), ("test", 4000)] {
        let lines: String = (0..n)
            .map(|i| {
                let text = ["good day sir", "buy cheap pills now"][i % 2];
                format!("{{\"label\":{},\"text\":\"{text} {i}\"}}\n", i % 2)
            })
            .collect();
        std::fs::write(data.join(format!("{split}.jsonl")), lines).unwrap();
    }
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let fine_tune = |out: &Path| {
        let o = bin()
            .args(["train", "--task", "classify", "--init-from", model])
            .args(["--data", data, "--epochs", "2", "--batch-size", "4"])
            .args(["--seq-len", "12", "--lr", "1e-3", "--quiet"])
            .args(["--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    let resume = |out: &Path, extra: &[&str]| {
        let mut c = bin();
        c.args(["train", "--task", "classify", "--quiet", "--resume"])
            .arg(out)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    };
    let report = |out: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(out.join("classify.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let whole = dir.join("whole");
    fine_tune(&whole);
    let o = resume(&whole, &["--steps", "8"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = dir.join("term");
    fine_tune(&out);
    assert!(out.join("classify.json").exists());
    let step = || {
        state::latest(&out)
            .and_then(|c| state::read_index(&c))
            .map_or(0, |i| i.step)
    };
    let logged =
        || std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |s| s.lines().count());
    // step 3 logged: step 4 trains (milliseconds), then is scored
    let child = resume(&out, &["--steps", "8"]).spawn().unwrap();
    wait_until("step 3 was not logged", || logged() >= 3);
    signal(child.id(), "TERM");
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(75), "{}", stderr(&o));
    let stopped = step();
    assert!((4..8).contains(&stopped), "stopped at step {stopped}");
    assert!(
        !out.join("classify.json").exists(),
        "classify.json of 2 steps kept beside the model of {stopped}"
    );
    // its checkpoint as the release before recorded the set (separators,
    // no lengths): still the run's own data, resumed
    let set = distgpt::data::labelled::LabelledSet::load(Path::new(data)).unwrap();
    let old = set.fingerprint_before_lengths();
    assert_ne!(old, set.fingerprint());
    edit_index(&state::latest(&out).unwrap(), |i| i.data = old, true);
    // the last step's checkpoint written: the test split is being scored
    let child = resume(&out, &[]).spawn().unwrap();
    wait_until("step 8 was not checkpointed", || step() == 8);
    signal(child.id(), "TERM");
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let (a, b) = (report(&whole), report(&out));
    assert_eq!(a["test"], b["test"]);
    assert_eq!(a["epochs"].as_array().unwrap().len(), 8);
    for e in 0..8 {
        assert_eq!(a["epochs"][e]["train_loss"], b["epochs"][e]["train_loss"]);
        assert_eq!(a["epochs"][e]["val"], b["epochs"][e]["val"]);
    }
    let eval = bin()
        .args(["eval", out.to_str().unwrap(), "--data", data])
        .args(["--batch-size", "4"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&eval.stdout).to_string();
    let loss = b["test"]["loss"].as_f64().unwrap();
    assert!(said.contains(&format!("loss {loss:.4},")), "{said}");
    let o = resume(&out, &[]).output().unwrap();
    assert!(
        stderr(&o).contains("nothing left to train"),
        "{}",
        stderr(&o)
    );
}

/// A `data prepare` stopped before its tokenizer.json leaves a folder that
/// `train` refuses in words, not one read as llm.c's GPT-2 BPE shards.
#[test]
fn an_unfinished_data_prepare_is_refused_not_read_as_gpt2() {
    let dir = tmp("unfinished-prepare");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("t.txt");
    let words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog"];
    let body: Vec<&str> = (0..3000).map(|i| words[(i * 3 + i / 7) % 8]).collect();
    std::fs::write(&text, body.join(" ")).unwrap();
    let shards = dir.join("shards");
    // a vocab.txt that cannot be written, as a full disk refuses it
    std::fs::create_dir_all(shards.join("vocab.txt")).unwrap();
    let prepare = |extra: &[&str]| {
        bin()
            .args(["data", "prepare", "--input", text.to_str().unwrap()])
            .args(["--tokenizer", "wordpiece", "--vocab-size", "200"])
            .args(["--out", shards.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    assert!(!prepare(&[]).status.success());
    assert!(!shards.join("tokenizer.json").exists());
    let read = train(
        &dir.join("run"),
        &["--steps", "1", "--data", shards.to_str().unwrap()],
    );
    assert!(!read.status.success());
    assert!(stderr(&read).contains("unfinished"), "{}", stderr(&read));
    std::fs::remove_dir(shards.join("vocab.txt")).unwrap();
    let redone = prepare(&["--overwrite"]);
    assert!(redone.status.success(), "{}", stderr(&redone));
    assert!(shards.join("tokenizer.json").exists());
    assert!(!shards.join("prepare.unfinished").exists());
}

/// A resume takes a fixed setting repeated as recorded (a run's own command
/// line with `--resume` added) and refuses what would continue a run other
/// than the one recorded: run.json edited, a step record it cannot read
/// and would drop, a checkpoint under another step's name.
#[test]
fn a_resume_takes_its_own_command_line_and_refuses_an_edited_record() {
    let dir = tmp("as-recorded");
    let resume = |steps: &str| train(&dir, &["--resume", dir.to_str().unwrap(), "--steps", steps]);
    let text = tmp("as-recorded-data").with_extension("txt");
    std::fs::write(
        &text,
        "To be, or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    let first = train(&dir, &["--steps", "2", "--data", text.to_str().unwrap()]);
    assert!(first.status.success(), "{}", stderr(&first));
    // every fixed flag, as the record holds it (train's own: model, batch
    // size, sequence length, out)
    let r = distgpt::train::run_dir::read_record(&dir).unwrap().train;
    let (a, data) = (r.adamw, r.data.map(|d| d.display().to_string()));
    let same: Vec<String> = [
        ("--seed", r.seed.to_string()),
        ("--grad-accum", r.grad_accum.to_string()),
        ("--warmup", r.warmup_steps.to_string()),
        ("--beta1", a.beta1.to_string()),
        ("--beta2", a.beta2.to_string()),
        ("--weight-decay", a.weight_decay.to_string()),
        ("--tokenizer", "char".into()),
        ("--data", data.unwrap_or_default()),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .flat_map(|(f, v)| [f.to_string(), v])
    .collect();
    let same: Vec<&str> = same.iter().map(String::as_str).collect();
    let as_recorded = train(
        &dir,
        &[
            &["--resume", dir.to_str().unwrap(), "--steps", "3"],
            &same[..],
        ]
        .concat(),
    );
    assert!(as_recorded.status.success(), "{}", stderr(&as_recorded));
    assert_eq!(metrics_steps(&dir), [1, 2, 3]);

    let record = dir.join("run.json");
    let text = std::fs::read_to_string(&record).unwrap();
    std::fs::write(&record, text.replace("\"seed\": 1337", "\"seed\": 1")).unwrap();
    let edited = resume("4");
    assert!(!edited.status.success());
    let err = stderr(&edited);
    assert!(err.contains("run.json") && err.contains("edited"), "{err}");
    std::fs::write(&record, &text).unwrap();

    let metrics = dir.join("metrics.jsonl");
    let lines = std::fs::read_to_string(&metrics).unwrap();
    let torn = lines.replacen("{", "garbage {", 1);
    std::fs::write(&metrics, &torn).unwrap();
    let unread = resume("4");
    assert!(!unread.status.success());
    let err = stderr(&unread);
    assert!(
        err.contains("metrics.jsonl") && err.contains("line 1"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), torn);
    // a last line a crash cut short goes, and metrics.csv may be gone
    std::fs::write(&metrics, format!("{lines}{{\"step\": 4, \"lo")).unwrap();
    let csv = dir.join("metrics.csv");
    std::fs::remove_file(&csv).unwrap();
    let cut = resume("4");
    assert!(cut.status.success(), "{}", stderr(&cut));
    assert_eq!(metrics_steps(&dir), [1, 2, 3, 4]);
    // but one that is no text is refused, by name
    std::fs::write(&csv, b"step\n\xff\xfe\n").unwrap();
    let unreadable = resume("5");
    assert!(!unreadable.status.success());
    assert!(
        stderr(&unreadable).contains("metrics.csv"),
        "{}",
        stderr(&unreadable)
    );
    std::fs::remove_file(&csv).unwrap();

    let ckpts = dir.join("checkpoints");
    std::fs::rename(ckpts.join("step_00000004"), ckpts.join("step_00000009")).unwrap();
    let renamed = resume("10");
    assert!(!renamed.status.success());
    let err = stderr(&renamed);
    assert!(err.contains("holds step 4, not the step 9"), "{err}");
    assert_eq!(metrics_steps(&dir), [1, 2, 3, 4]);
}

/// `--overwrite` never empties a run folder that holds the new run's data;
/// TensorBoard files never land in another run; a path run.json cannot
/// record and an evaluation of no batches are refused before anything is
/// written.
#[test]
fn a_new_run_refuses_outputs_that_would_lose_its_inputs_or_another_run() {
    let dir = tmp("overwrite-inputs");
    assert!(train(&dir, &["--steps", "1"]).status.success());
    let data = dir.join("mydata.txt");
    std::fs::write(
        &data,
        "To be, or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    let over = train(
        &dir,
        &[
            "--steps",
            "1",
            "--overwrite",
            "--data",
            data.to_str().unwrap(),
        ],
    );
    assert!(!over.status.success());
    assert!(stderr(&over).contains("--data"), "{}", stderr(&over));
    assert!(data.exists() && dir.join("run.json").exists());

    let other = tmp("tensorboard-into-a-run");
    let tb = ["--steps", "1", "--tensorboard", dir.to_str().unwrap()];
    let into = train(&other, &tb);
    assert!(!into.status.success());
    assert!(stderr(&into).contains("--tensorboard"), "{}", stderr(&into));
    // a run's own folder is not another run's, new or resumed
    let own = ["--tensorboard", other.to_str().unwrap()];
    assert!(train(&other, &[&["--steps", "1"], &own[..]].concat())
        .status
        .success());
    let more = [
        &["--resume", other.to_str().unwrap(), "--steps", "2"],
        &own[..],
    ]
    .concat();
    let resumed = train(&other, &more);
    assert!(resumed.status.success(), "{}", stderr(&resumed));

    use std::os::unix::ffi::OsStrExt;
    let odd = tmp("utf8").join(std::ffi::OsStr::from_bytes(b"bad\xff\xfename"));
    let out = bin()
        .args([
            "train", "--model", "tiny", "--steps", "1", "--quiet", "--out",
        ])
        .arg(&odd)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("not valid UTF-8"),
        "{err}"
    );
    assert!(!err.contains("panicked") && !odd.exists(), "{err}");

    // not through `train`, which sets --eval-batches already
    let none = bin()
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--eval-batches",
            "0",
        ])
        .arg("--out")
        .arg(tmp("no-eval-batches"))
        .output()
        .unwrap();
    assert!(!none.status.success());
    assert!(
        stderr(&none).contains("--eval-batches"),
        "{}",
        stderr(&none)
    );
}

/// A resume that fails on a full disk changes nothing of the run: it had
/// set newer checkpoints aside, cut the logs back, removed the model's
/// files and appended to run.json before the write that failed, so a
/// finished run was taken back to step 2 for good.
#[test]
fn a_resume_that_fails_on_a_full_disk_leaves_the_run_as_it_was() {
    let dir = tmp("full-disk-resume");
    let first = train(&dir, &["--steps", "6", "--checkpoint-every", "2"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let before = contents(&dir);
    let run = dir.to_str().unwrap();
    let resume = ["train", "--resume", run, "--quiet", "--peak-tflops", "0.1"];
    for extra in [&["--from-step", "2"][..], &["--steps", "8"]] {
        let o = on_a_full_disk(1, &[&resume[..], extra].concat());
        assert!(!o.status.success(), "{extra:?} trained");
        assert!(stderr(&o).contains("File too large"), "{}", stderr(&o));
        assert!(contents(&dir) == before, "{extra:?} changed the run");
    }
}

/// A new run that fails on a full disk leaves its folder empty, for the
/// same command to use again: it left the logs it had opened and no
/// run.json, a folder "not empty and holds no run" even to --overwrite.
#[test]
fn a_new_run_that_fails_on_a_full_disk_leaves_its_folder_to_the_same_command() {
    let dir = tmp("full-disk-new");
    let (out, events) = (dir.to_str().unwrap(), dir.join("tb"));
    let args = ["train", "--model", "tiny", "--steps", "1", "--quiet"];
    let args = [&args[..], &["--peak-tflops", "0.1", "--out", out]].concat();
    // its TensorBoard folder inside it, made by the start, goes too
    let args = [&args[..], &["--tensorboard", events.to_str().unwrap()]].concat();
    let o = on_a_full_disk(1, &args);
    assert!(
        !o.status.success() && stderr(&o).contains("File too large"),
        "{}",
        stderr(&o)
    );
    assert_eq!(contents(&dir), []);
    let again = bin().args(&args).output().unwrap();
    assert!(again.status.success(), "{}", stderr(&again));
}

/// `--overwrite` with a `--tensorboard` that cannot be used is refused
/// before the old run is emptied (it emptied it, then refused).
#[test]
fn an_overwrite_refused_for_its_tensorboard_folder_keeps_the_old_run() {
    let dir = tmp("overwrite-tensorboard-file");
    let first = train(&dir, &["--steps", "2"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let before = contents(&dir);
    let file = tmp("overwrite-tensorboard-file-events");
    std::fs::write(&file, "not a folder").unwrap();
    let tb = [
        "--steps",
        "2",
        "--overwrite",
        "--tensorboard",
        file.to_str().unwrap(),
    ];
    let o = train(&dir, &tb);
    assert!(
        !o.status.success() && stderr(&o).contains("is a file"),
        "{}",
        stderr(&o)
    );
    assert!(contents(&dir) == before, "the old run was changed");
}

/// A checkpoint whose write fails on a full disk leaves no part of itself
/// (its `step_N.tmp` kept the ranks' files written so far, holding the
/// disk full), and the run stops saying which file.
#[test]
fn a_checkpoint_that_fails_on_a_full_disk_leaves_no_part_of_it() {
    let dir = tmp("full-disk-checkpoint");
    let out = dir.to_str().unwrap();
    let args = ["train", "--model", "tiny", "--steps", "2", "--quiet"];
    let args = [
        &args[..],
        &["--checkpoint-every", "1", "--peak-tflops", "0.1"],
    ]
    .concat();
    let o = on_a_full_disk(64, &[&args[..], &["--out", out]].concat());
    assert!(!o.status.success(), "trained");
    assert!(
        stderr(&o).contains("rank_0.safetensors: File too large"),
        "{}",
        stderr(&o)
    );
    let names: Vec<_> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(names.is_empty(), "{names:?}");
}
