//! The spellings a release had and a later one renamed: each keeps
//! working, hidden from `--help`, and says once what it is now.

use clap::Args;
use std::path::PathBuf;

/// Says, on one line, that `old` is an earlier spelling of `new`: every
/// flag a release had keeps working, hidden from `--help`.
pub(super) fn old_spelling(old: &str, new: &str) {
    distgpt::errln!("note: `{old}` is the old spelling of `{new}`; it still works");
}

/// RUN, given as the positional or as the old `--run RUN`.
pub(super) fn run_or_old_flag(
    command: &str,
    run: Option<PathBuf>,
    old: Option<PathBuf>,
) -> PathBuf {
    match (run, old) {
        (Some(run), _) => run,
        (None, Some(old)) => {
            old_spelling(&format!("{command} --run RUN"), &format!("{command} RUN"));
            old
        }
        (None, None) => unreachable!("clap requires RUN or --run"),
    }
}

/// `--peak-gflops G`, the spelling before `--peak-tflops` (hidden; the
/// commands that take --peak-tflops flatten it in).
#[derive(Args, Clone)]
pub(super) struct OldPeakGflops {
    /// `--peak-gflops G`: the spelling before --peak-tflops (G / 1000 of it).
    #[arg(
        long = "peak-gflops",
        value_name = "GFLOPS",
        hide = true,
        conflicts_with = "peak_tflops",
        value_parser = peak_gflops
    )]
    old_peak_gflops: Option<f64>,
}

impl OldPeakGflops {
    /// --peak-tflops, or the old --peak-gflops converted.
    pub(super) fn or_stated(&self, tflops: Option<f64>) -> Option<f64> {
        tflops.or_else(|| {
            let g = self.old_peak_gflops?;
            old_spelling("--peak-gflops G", "--peak-tflops G/1000");
            Some(g / 1000.0)
        })
    }
}

/// The parser of the old `--peak-gflops`: [`super::peak_tflops`]'s rule, in GFLOP/s.
fn peak_gflops(s: &str) -> std::result::Result<f64, String> {
    super::peak(s, 1e9, "GFLOP/s")
}
