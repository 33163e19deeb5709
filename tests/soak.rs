//! Kill-and-resume soak, for every task (GPT-2 LM, BERT MLM, BERT
//! classifier): a run is interrupted at random moments by SIGKILL, SIGTERM
//! or SIGINT (under `mpirun`: SIGINT, SIGTERM or SIGUSR2 to mpirun, or
//! SIGKILL to one rank), resumed each time with `--resume RUN` alone, and
//! must end with the uninterrupted run's final weights, bit for bit, with
//! every step logged once. The seed is printed so a failing sequence can be
//! replayed (DISTGPT_SOAK_SEED).

#![cfg(unix)]

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

#[path = "support/bert.rs"]
mod bert;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Steps of each task's run: each takes a few seconds uninterrupted, longer
/// than the longest wait before an interruption (1.05 s).
const STEPS: &str = "1500";
const MLM_STEPS: &str = "600";
const CLASSIFY_STEPS: &str = "3000";

/// A tiny xorshift generator: the interruption schedule.
struct Dice(u64);

impl Dice {
    fn from_env() -> Self {
        let seed = std::env::var("DISTGPT_SOAK_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("soak seed {seed} (DISTGPT_SOAK_SEED={seed} replays it)");
        Dice(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn tmp(tag: &str) -> PathBuf {
    scratch(&format!("soak-{tag}"))
}

/// A soak's task: its flags, and the steps it trains.
struct Task {
    tag: &'static str,
    flags: Vec<String>,
    steps: &'static str,
}

/// The three tasks (the classifier's folder and set made in `fixtures`).
fn tasks(fixtures: &Path) -> [Task; 3] {
    let (model, data) = bert::tiny_bert_and_labelled_set(fixtures);
    let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect();
    [
        Task {
            tag: "lm",
            flags: flags(&["--model", "tiny", "--seq-len", "32"]),
            steps: STEPS,
        },
        Task {
            tag: "mlm",
            flags: flags(&["--model", "bert-tiny", "--seq-len", "16"]),
            steps: MLM_STEPS,
        },
        Task {
            tag: "classify",
            flags: flags(&[
                "--task",
                "classify",
                "--init-from",
                model.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--seq-len",
                "12",
                "--lr",
                "1e-3",
            ]),
            steps: CLASSIFY_STEPS,
        },
    ]
}

/// The training flags every invocation of `task` shares (ddp on two ranks).
fn train_args(task: &Task, out: &Path) -> Vec<String> {
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(task.flags.iter().cloned());
    args.extend(
        [
            "--steps",
            task.steps,
            "--batch-size",
            "4",
            "--strategy",
            "ddp",
            "--world-size",
            "2",
            "--checkpoint-every",
            "7",
            "--eval-every",
            "0",
            "--quiet",
            "--peak-tflops",
            "0.1",
            "--out",
            out.to_str().unwrap(),
        ]
        .map(String::from),
    );
    args
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status();
}

/// How one invocation is started and interrupted.
struct Launcher {
    /// The command for these training arguments.
    command: fn(&[String]) -> Command,
    /// Interrupts a running invocation; returns what it did.
    interrupt: fn(&Child, &mut Dice) -> String,
}

/// Runs to the end through random interruptions; returns how many there were.
fn soak(launcher: &Launcher, task: &Task, dir: &Path, dice: &mut Dice) -> usize {
    let mut interruptions = 0;
    let t0 = Instant::now();
    loop {
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "the soak did not finish"
        );
        let started =
            dir.join("checkpoints").exists() && distgpt::checkpoint::state::latest(dir).is_ok();
        let mut args = train_args(task, dir);
        if started {
            args = vec!["train".into(), "--resume".into(), dir.display().to_string()];
            args.extend(["--quiet".into()]);
        } else if dir.exists() {
            args.push("--overwrite".into());
        }
        let child = (launcher.command)(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let wait_ms = 150 + dice.below(900);
        let deadline = Instant::now() + Duration::from_millis(wait_ms);
        let mut child = child;
        while Instant::now() < deadline && child.try_wait().unwrap().is_none() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let what = if child.try_wait().unwrap().is_none() && interruptions < 12 {
            interruptions += 1;
            (launcher.interrupt)(&child, dice)
        } else {
            "none".into()
        };
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!(
            "interruption {interruptions}: {what}: exit {:?}",
            out.status.code()
        );
        match out.status.code() {
            Some(0) => return interruptions,
            // A resume of a run whose final checkpoint was written just before the kill.
            Some(1) if err.contains("nothing left to train") => return interruptions,
            Some(75) => assert!(what != "none", "stopped without being interrupted: {err}"),
            _ => assert!(what != "none", "failed without being interrupted: {err}"),
        }
    }
}

fn thread_command(args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_distgpt"));
    c.args(args);
    c
}

fn thread_interrupt(child: &Child, dice: &mut Dice) -> String {
    let sig = ["KILL", "TERM", "INT"][dice.below(3) as usize];
    signal(child.id(), sig);
    format!("SIG{sig} to the process")
}

fn check_against_uninterrupted(launcher: &Launcher, tag: &str) {
    let fixtures = tmp(&format!("{tag}-fixtures"));
    for task in tasks(&fixtures) {
        let tag = format!("{tag}-{}", task.tag);
        let whole = tmp(&format!("{tag}-whole"));
        let out = (launcher.command)(&train_args(&task, &whole))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = tmp(&tag);
        let mut dice = Dice::from_env();
        let n = soak(launcher, &task, &dir, &mut dice);
        assert!(n >= 1, "{tag}: the run was never interrupted");
        let read = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert!(
            read(&dir) == read(&whole),
            "{tag}: after {n} interruptions the final weights differ from the uninterrupted run's"
        );
        let steps: Vec<u64> = std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        let expected: Vec<u64> = (1..=task.steps.parse().unwrap()).collect();
        assert_eq!(steps, expected, "{tag}: metrics.jsonl logs every step once");
    }
}

#[test]
fn thread_ranks_killed_at_random_resume_to_the_same_weights() {
    check_against_uninterrupted(
        &Launcher {
            command: thread_command,
            interrupt: thread_interrupt,
        },
        "threads",
    );
}

#[cfg(feature = "mpi")]
fn mpi_command(args: &[String]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .args(["--comm", "mpi"]);
    c
}

#[cfg(feature = "mpi")]
fn mpi_interrupt(child: &Child, dice: &mut Dice) -> String {
    match dice.below(4) {
        0 => {
            // One rank dies outright; mpirun stops the other.
            let ranks = Command::new("pgrep")
                .args(["-P", &child.id().to_string()])
                .output()
                .unwrap();
            let pids = String::from_utf8_lossy(&ranks.stdout);
            match pids.split_whitespace().next() {
                Some(pid) => {
                    signal(pid.parse().unwrap(), "KILL");
                    format!("SIGKILL to rank process {pid}")
                }
                None => "none found to kill".into(),
            }
        }
        k => {
            let sig = ["INT", "TERM", "USR2"][k as usize - 1];
            signal(child.id(), sig);
            format!("SIG{sig} to mpirun")
        }
    }
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_ranks_interrupted_at_random_resume_to_the_same_weights() {
    check_against_uninterrupted(
        &Launcher {
            command: mpi_command,
            interrupt: mpi_interrupt,
        },
        "mpi",
    );
}
