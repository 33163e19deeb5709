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
    /// Write into --out even when it already holds files (the default
    /// RUN/plots is always redrawn).
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: PlotArgs) -> Result<()> {
    if let Some(out) = &a.out {
        super::claim_out(out, "--out", "a folder of figures", a.overwrite)?;
    }
    let out = a.out.unwrap_or_else(|| match a.runs.as_slice() {
        [one] => one.join("plots"),
        _ => PathBuf::from("plots"),
    });
    let written = distgpt::plot::plot(&a.runs, &out)?;
    distgpt::outln!("wrote {} figures into {}", written.len(), out.display());
    Ok(())
}
