//! `distgpt plot`: PNG and SVG figures of one or more runs' metrics.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct PlotArgs {
    /// Run directories written by `distgpt train` (their metrics.jsonl).
    #[arg(value_name = "RUN", required = true)]
    runs: Vec<PathBuf>,
    /// Output directory (default: RUN/plots for one run, ./plots for several).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write into --out (or the default ./plots) even when it already holds
    /// files (one run's own RUN/plots is always redrawn).
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: PlotArgs) -> Result<()> {
    let (out, own) = match (a.out, a.runs.as_slice()) {
        (Some(out), _) => (out, false),
        (None, [one]) => (one.join("plots"), true),
        (None, _) => (PathBuf::from("plots"), false),
    };
    // another comparison's figures in ./plots are not replaced silently
    if !own {
        super::claim_out(&out, "--out", "a folder of figures", a.overwrite)?;
    }
    let written = distgpt::plot::plot(&a.runs, &out)?;
    distgpt::outln!("wrote {} figures into {}", written.len(), out.display());
    Ok(())
}
