//! Metrics: per-step JSON Lines records, MFU, byte formatting and the
//! progress bar.

use crate::backend::MemoryReport;
use crate::comm::CommStats;
use crate::error::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    pub step: usize,
    pub epoch: f64,
    pub loss: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    pub grad_norm: f32,
    pub lr: f32,
    pub ms: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// Rank 0's memory counters.
    pub memory: MemoryReport,
    /// Peak bytes per rank: [params, grads, optimizer, activations, other, total].
    pub rank_peak_bytes: Vec<Vec<u64>>,
    /// Rank 0's communication so far.
    pub comm: CommStats,
}

/// Appends records as JSON Lines.
pub struct JsonlWriter {
    out: BufWriter<File>,
    path: std::path::PathBuf,
}

impl JsonlWriter {
    pub fn create(path: &Path) -> Result<Self> {
        let f = File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter {
            out: BufWriter::new(f),
            path: path.into(),
        })
    }

    /// Appends to an existing file (a resumed run).
    pub fn append(path: &Path) -> Result<Self> {
        let f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter {
            out: BufWriter::new(f),
            path: path.into(),
        })
    }

    pub fn write<T: Serialize>(&mut self, record: &T) -> Result<()> {
        let line = serde_json::to_string(record).expect("records serialise");
        writeln!(self.out, "{line}")
            .and_then(|_| self.out.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// Model FLOPs utilisation: achieved over peak.
pub fn mfu(flops_per_token: f64, tokens_per_s: f64, peak_flops: f64) -> f64 {
    flops_per_token * tokens_per_s / peak_flops
}

/// 1536 -> "1.5 KiB".
pub fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// Peak bytes by category on one line.
pub fn memory_line(m: &MemoryReport) -> String {
    let p = &m.peak_bytes;
    format!(
        "params {} | grads {} | optimizer {} | activations {} | peak total {}",
        human_bytes(p.params),
        human_bytes(p.grads),
        human_bytes(p.optimizer),
        human_bytes(p.activations),
        human_bytes(m.peak_total_bytes)
    )
}

/// A progress bar over `len` items, drawn on stderr when it is a terminal.
pub fn progress_bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template(&format!(
        "{what} {{bar:30.cyan/blue}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}] {{msg}}"
    ))
    .expect("static template")
    .progress_chars("=> ");
    pb.set_style(style);
    pb
}

/// Prints above the bar, or to stderr when the bar is hidden (not a terminal).
pub fn say(pb: &ProgressBar, msg: &str) {
    if pb.is_hidden() {
        crate::errln!("{msg}");
    } else {
        pb.println(msg);
    }
}

/// `println!` that shrugs off a closed stdout (`distgpt train | head`):
/// output is a courtesy, the run is what matters.
#[macro_export]
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// `print!` (flushed) that shrugs off a closed stdout.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let mut o = std::io::stdout();
        let _ = write!(o, $($t)*).and_then(|_| o.flush());
    }};
}

/// `eprintln!` that shrugs off a closed stderr.
#[macro_export]
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_humanised() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }
}
