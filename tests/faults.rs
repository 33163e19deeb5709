//! A failing rank stops every other rank with an error naming it, well inside
//! the timeout; impossible layouts are refused before any work.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::train::{train_lm, Duration, Fault, FaultKind, TrainConfig};
use std::process::Command;
use std::time::{Duration as Wait, Instant};

fn tiny_run(fault: Option<Fault>) -> TrainConfig {
    let out_dir = scratch("fault");
    TrainConfig {
        seq_len: 32,
        duration: Duration::Steps(6),
        seed: 1,
        out_dir,
        peak_flops: Some(1e11),
        fault,
        ..TrainConfig::default()
    }
}

#[test]
fn a_failing_thread_rank_is_named_and_nobody_hangs() {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    let par = ParallelConfig {
        strategy: StrategyKind::Fsdp,
        world_size: 4,
        tp: 1,
        recompute: false,
        precision: Default::default(),
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    };
    let t0 = Instant::now();
    let err = train_lm(
        Cpu::new,
        model,
        &ds,
        &tiny_run(Some(Fault {
            rank: 2,
            step: 3,
            how: FaultKind::Error,
        })),
        par,
        2,
        Wait::from_secs(30),
    )
    .expect_err("the run must fail")
    .to_string();
    assert!(err.contains("injected fault on rank 2 at step 3"), "{err}");
    assert!(
        t0.elapsed() < Wait::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
}

fn distgpt(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn impossible_layouts_are_refused_with_what_to_change() {
    let base = [
        "train",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--quiet",
        "--batch-size",
        "6",
    ];
    let cases: [(&[&str], &str); 4] = [
        (
            &["--strategy", "tp", "--world-size", "3"],
            "n_head (2) is not divisible by the tensor-parallel size 3",
        ),
        (
            &["--strategy", "ddp", "--world-size", "3", "--tp", "2"],
            "world size 3 is not divisible by the tensor-parallel size 2",
        ),
        (
            &["--strategy", "ddp", "--world-size", "4"],
            "global batch of 6 sequences is not divisible by the data-parallel size 4",
        ),
        (
            &["--strategy", "single", "--world-size", "2"],
            "strategy single runs on one rank",
        ),
    ];
    for (extra, want) in cases {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (ok, err) = distgpt(&args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// What a job printed, its standard output then its errors.
#[cfg(feature = "mpi")]
fn printed(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `distgpt train` of the tiny model under `mpirun -np N` (ddp, or the
/// layout in `extra`) where rank `rank` fails at step 2 as `how` says; the
/// job's output and how long it took.
#[cfg(feature = "mpi")]
fn mpirun_with_a_fault(np: usize, extra: &[&str], rank: usize, how: &str) -> (bool, String, Wait) {
    let out_dir = scratch(&format!("mpi-fault-{how}"));
    let (np, rank) = (np.to_string(), rank.to_string());
    let t0 = Instant::now();
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np])
        .arg(env!("CARGO_BIN_EXE_distgpt"))
        .args([
            "train",
            "--comm",
            "mpi",
            "--strategy",
            "ddp",
            "--world-size",
            &np,
        ])
        .args(["--model", "tiny", "--batch-size", "6", "--seq-len", "32"])
        .args(["--steps", "10", "--quiet", "--fail-step", "2"])
        .args(["--fail-rank", &rank, "--fail-how", how])
        .args(extra)
        .args(["--comm-timeout", "5", "--out", &out_dir.to_string_lossy()])
        .output()
        .expect("mpirun runs");
    let _ = std::fs::remove_dir_all(&out_dir);
    (out.status.success(), printed(&out), t0.elapsed())
}

#[cfg(feature = "mpi")]
#[test]
fn a_failing_mpi_rank_stops_the_job_and_is_named() {
    let (ok, text, took) = mpirun_with_a_fault(2, &[], 1, "error");
    assert!(!ok, "{text}");
    assert!(
        text.contains("injected fault on rank 1 at step 2"),
        "{text}"
    );
    // Open MPI's own "MPI_ABORT was invoked on rank 1" banner is not
    // asserted: its help-text machinery sometimes fails to print it.
    assert!(took < Wait::from_secs(20), "took {took:?}");
}

/// A rank that panics ends the job as one that fails does, at once and
/// named with its panic's message, not after the others' --comm-timeout
/// as "did not answer".
#[cfg(feature = "mpi")]
#[test]
fn a_panicking_mpi_rank_stops_the_job_and_is_named() {
    let (ok, text, took) = mpirun_with_a_fault(2, &[], 1, "panic");
    assert!(!ok, "{text}");
    assert!(
        text.contains("rank 1 panicked: injected panic on rank 1 at step 2"),
        "{text}"
    );
    assert!(!text.contains("did not answer"), "{text}");
    assert!(took < Wait::from_secs(4), "took {took:?}");
}

/// A rank that stops (SIGSTOP) or hangs outside MPI misses the others'
/// collective: each waiting rank's watchdog names it, and says which it is.
#[cfg(feature = "mpi")]
#[test]
fn a_stopped_or_hung_mpi_rank_is_named_by_the_ranks_it_holds_up() {
    let cases = [
        (
            "stop",
            3,
            2,
            &[][..],
            "rank 2 did not answer within 3 s: stopped",
        ),
        (
            "hang",
            3,
            1,
            &[][..],
            "rank 1 is outside any collective for",
        ),
        // Pipeline stages wait on each other point to point.
        (
            "stop",
            2,
            0,
            &["--pp", "2", "--grad-accum", "2"][..],
            "rank 0 did not answer",
        ),
    ];
    for (how, np, rank, extra, want) in cases {
        let (ok, text, took) = mpirun_with_a_fault(np, extra, rank, how);
        assert!(!ok, "{how}: {text}");
        let verdicts: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("did not complete within 5 s"))
            .collect();
        assert!(
            !verdicts.is_empty(),
            "{how}: no rank reported the stuck call:\n{text}"
        );
        for v in &verdicts {
            assert!(v.contains(want), "{how} {extra:?}: {v}\n{text}");
        }
        assert!(took < Wait::from_secs(40), "{how}: took {took:?}");
    }
}

/// Under mpirun each process has its own command line: ranks given other
/// settings than rank 0 are refused at set-up, naming the rank and the
/// setting. Unchecked, a rank of another model shape wrote past Open MPI's
/// buffers (`free(): invalid next size` in its all-reduce) and one of
/// another learning rate or seed trained what no record says.
#[cfg(feature = "mpi")]
#[test]
fn mpi_ranks_given_other_settings_are_refused_naming_the_setting() {
    let out_dir = scratch("mpi-settings");
    for (extra, says) in [
        ("--lr 0.1", "settings.lr is 0.1 (rank 0's: 0.003)"),
        ("--seed 7", "settings.seed is 7 (rank 0's: 1337)"),
        ("--n-layer 3", "model.n_layer is 3 (rank 0's: 2)"),
        ("--recompute", "layout.recompute is true (rank 0's: false)"),
    ] {
        // rank 1 alone gets `extra`
        let script = format!(
            r#"if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exec "$0" "$@" {extra}; fi; exec "$0" "$@""#
        );
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
            .args(["sh", "-c", &script, env!("CARGO_BIN_EXE_distgpt")])
            .args([
                "train",
                "--comm",
                "mpi",
                "--strategy",
                "ddp",
                "--world-size",
                "2",
            ])
            .args(["--model", "tiny", "--batch-size", "4", "--seq-len", "16"])
            .args([
                "--steps",
                "3",
                "--quiet",
                "--comm-timeout",
                "10",
                "--overwrite",
            ])
            .args(["--out", &out_dir.to_string_lossy()])
            .output()
            .expect("mpirun runs");
        let text = printed(&out);
        assert!(!out.status.success(), "{extra}: {text}");
        assert!(
            text.contains("rank 1 was given other settings than rank 0") && text.contains(says),
            "{extra}: {text}"
        );
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
