//! Metrics: per-step JSON Lines records, MFU, byte formatting and the
//! progress bar.

pub mod peak;
pub mod tensorboard;

use crate::backend::{MemoryReport, PeakRow};
use crate::comm::CommStats;
use crate::error::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// One line of `metrics.jsonl`. Its figures that are no number (a NaN
/// loss, an MFU against a peak that could not be measured) are written
/// `null`, as JSON has no NaN, and read back as NaN.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct StepRecord {
    pub step: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub epoch: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    /// A classifier's validation accuracy and F1 (with `val_loss`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_accuracy: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_f1: Option<f64>,
    /// Examples the validation figures are over.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_examples: Option<usize>,
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f32,
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f32,
    #[serde(deserialize_with = "nan_if_null")]
    pub ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub mfu: f64,
    /// Rank 0's memory counters.
    pub memory: MemoryReport,
    /// Peak bytes per rank: [params, grads, optimizer, activations, other, total].
    pub rank_peak_bytes: Vec<PeakRow>,
    /// Under offload, each rank's peak host bytes (the same categories).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_host_peak_bytes: Vec<PeakRow>,
    /// Rank 0's communication so far.
    pub comm: CommStats,
}

/// The epochs read whole at `epoch`, a step record's position in epochs
/// (past float noise: 0.99999999999 is 1). A step belongs to the epoch it
/// began in: the one its previous record's position is in.
pub fn whole_epochs(epoch: f64) -> usize {
    (epoch + 1e-9).floor() as usize
}

/// A float, or NaN where JSON holds `null` (how serde_json writes NaN).
fn nan_if_null<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + From<f32>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or(T::from(f32::NAN)))
}

/// A log of a line a record, each flushed as it is written: JSON Lines
/// (`metrics.jsonl`) or the scalars of each step as CSV (`metrics.csv`
/// beside it, for spreadsheets and plotting tools).
pub struct LineWriter {
    out: BufWriter<File>,
    path: std::path::PathBuf,
}

impl LineWriter {
    pub const CSV_HEADER: &'static str =
        "step,epoch,loss,val_loss,grad_norm,lr,ms,tokens_per_s,mfu,peak_bytes,comm_bytes,val_accuracy,val_f1";

    /// A new file starting with `header` (where given), or (`append`) the
    /// end of an existing one. Written at its end either way, so a file cut
    /// short by another process (logrotate's copytruncate) goes on from its
    /// new end, not from past it over a hole of zeros.
    pub fn open(path: &Path, append: bool, header: Option<&str>) -> Result<Self> {
        let fresh = !append || !path.exists();
        let opened = || {
            if fresh {
                std::fs::File::create(path)?;
            }
            std::fs::OpenOptions::new().append(true).open(path)
        };
        let f = opened().map_err(|e| Error::io(path, e))?;
        let mut w = LineWriter {
            out: BufWriter::new(f),
            path: path.into(),
        };
        if let (true, Some(header)) = (fresh, header) {
            w.line(header)?;
        }
        Ok(w)
    }

    fn line(&mut self, line: &str) -> Result<()> {
        writeln!(self.out, "{line}")
            .and_then(|_| self.out.flush())
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Appends `record` as a line of JSON.
    pub fn json<T: Serialize>(&mut self, record: &T) -> Result<()> {
        self.line(&serde_json::to_string(record).expect("records serialise"))
    }

    /// Appends `r`'s scalars as a line of CSV under `CSV_HEADER`.
    pub fn csv(&mut self, r: &StepRecord) -> Result<()> {
        let line = format!(
            "{},{:.6},{},{},{},{:e},{:.3},{:.1},{:.4},{},{},{},{}",
            r.step,
            r.epoch,
            r.loss,
            r.val_loss.map_or(String::new(), |v| v.to_string()),
            r.grad_norm,
            r.lr,
            r.ms,
            r.tokens_per_s,
            r.mfu,
            r.memory.peak_row().total,
            r.comm.total_bytes(),
            r.val_accuracy.map_or(String::new(), |v| v.to_string()),
            r.val_f1.map_or(String::new(), |v| v.to_string())
        );
        self.line(&line)
    }
}

/// 75 -> "1m15s"; 4000 -> "1h06m".
pub fn human_duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s / 60 % 60),
    }
}

/// Model FLOPs utilisation: achieved over peak.
pub fn mfu(flops_per_token: f64, tokens_per_s: f64, peak_flops: f64) -> f64 {
    flops_per_token * tokens_per_s / peak_flops
}

/// What to say when a run's MFU is above 100%: the peak it divides by
/// (measured once and kept, `peak`, or `stated` with --peak-tflops) is
/// below what the machine just did.
pub fn mfu_above_peak(mfu: f64, stated: bool) -> Option<String> {
    (mfu > 1.0).then(|| match stated {
        true => format!(
            "MFU {:.1}% is above 100%: the --peak-tflops given is below what this run achieved",
            100.0 * mfu
        ),
        false => format!(
            "MFU {:.1}% is above 100%: the kept peak is below what this run achieved (it was \
             measured under load, or on another CPU of the same name); measure it again on a \
             quiet machine with `distgpt devices --measure`, or state one with --peak-tflops",
            100.0 * mfu
        ),
    })
}

/// Bytes in a MiB, as reports give memory.
pub const MIB: f64 = 1024.0 * 1024.0;

/// Seconds since the Unix epoch (0 on a clock before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `YYYYMMDD-HHMMSS` (UTC) of Unix seconds.
pub fn timestamp(secs: u64) -> String {
    // Days to a civil date (Howard Hinnant's algorithm).
    let days = (secs / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let s = secs % 86_400;
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        s / 3_600,
        s / 60 % 60,
        s % 60
    )
}

/// `YYYY-MM-DD` (UTC) of Unix seconds.
pub fn date(secs: u64) -> String {
    let t = timestamp(secs);
    format!("{}-{}-{}", &t[..4], &t[4..6], &t[6..8])
}

/// "1 rank", "2 ranks": a count with its noun in the number it needs.
pub fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ => format!("{n} {noun}s"),
    }
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

/// A table as lines: each column as wide as its widest cell, those in
/// `left` left-aligned, the others right-aligned, two spaces between.
pub fn table(header: &[&str], rows: &[Vec<String>], left: &[usize]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            let pad = " ".repeat(w - cell.chars().count());
            let gap = if i == 0 { "" } else { "  " };
            match left.contains(&i) {
                true => out += &format!("{gap}{cell}{pad}"),
                false => out += &format!("{gap}{pad}{cell}"),
            }
        }
        out.trim_end().to_string()
    };
    let mut out = vec![line(&mut header.iter().copied())];
    out.extend(rows.iter().map(|r| line(&mut r.iter().map(String::as_str))));
    out
}

/// This process's peak resident memory (Linux's VmHWM), if known: every
/// rank of the process with what the categories do not count (the
/// loader, kernel workspaces and packing buffers, thread stacks, the
/// allocator's slack, the binary).
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// This process's resident memory now (Linux's VmRSS), if known.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

/// The host memory available now (Linux's MemAvailable), if known.
pub fn available_memory_bytes() -> Option<u64> {
    kib_line("/proc/meminfo", "MemAvailable:")
}

fn status_bytes(key: &str) -> Option<u64> {
    kib_line("/proc/self/status", key)
}

/// A `/proc` file's "KEY: N kB" line, in bytes.
fn kib_line(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Peak bytes by category on one line.
pub fn memory_line(m: &MemoryReport) -> String {
    let p = &m.peak_bytes;
    let mut line = format!(
        "params {} | grads {} | optimizer {} | activations {} | other {} | peak total {}",
        human_bytes(p.params),
        human_bytes(p.grads),
        human_bytes(p.optimizer),
        human_bytes(p.activations),
        human_bytes(p.other),
        human_bytes(m.peak_total_bytes)
    );
    if let Some((free, total)) = m.device_free_total {
        line += &format!(
            " | device {} free of {} (driver)",
            human_bytes(free),
            human_bytes(total)
        );
    }
    if let Some(h) = &m.host {
        let p = &h.peak_bytes;
        line += &format!(
            " || host (offload): params {} | grads {} | optimizer {} | peak total {}",
            human_bytes(p.params),
            human_bytes(p.grads),
            human_bytes(p.optimizer),
            human_bytes(h.peak_total_bytes)
        );
    }
    line
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

/// `eprintln!` that shrugs off a closed stderr, the line written at once:
/// the lines of processes sharing it (mpirun's ranks) do not interleave,
/// where a line written in its pieces did ("error: rank error: rank 1...").
#[macro_export]
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = std::io::stderr().write_all(format!("{}\n", format_args!($($t)*)).as_bytes());
    }};
}

/// Median and range of a value over repeats (a `compare` cell's, `prune`'s
/// timed steps).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The median (mean of the middle two for an even count), min and max; NaN when empty.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Spread {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }

    /// A value that does not vary.
    pub fn exact(v: f64) -> Spread {
        Spread {
            median: v,
            min: v,
            max: v,
        }
    }

    /// (max - min) / median, in percent.
    pub fn range_percent(&self) -> f64 {
        100.0 * (self.max - self.min) / self.median
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log cut to nothing by another process (logrotate's copytruncate)
    /// goes on from its new end: a fresh file was written at its own
    /// offset, past a hole of zeros that no reader takes for a record.
    #[test]
    fn a_log_cut_short_by_another_process_goes_on_from_its_new_end() {
        let dir = crate::testdir::TestDir::new("cut-log");
        let path = dir.path().join("metrics.csv");
        let mut w = LineWriter::open(&path, false, Some("step")).unwrap();
        w.line("1").unwrap();
        let other = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        other.set_len(0).unwrap();
        w.line("2").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "2\n");
    }

    /// A record whose figures are no number is written `null` and read back
    /// as NaN: `read_metrics` dropped it (reports and plots lost the step).
    #[test]
    fn the_memory_line_names_every_category_the_peak_counts() {
        let mut m = MemoryReport::default();
        (m.peak_bytes.params, m.peak_bytes.grads) = (1024, 2048);
        (m.peak_bytes.optimizer, m.peak_bytes.activations) = (3072, 5 << 20);
        (m.peak_bytes.other, m.peak_total_bytes) = (512, 6 << 20);
        assert_eq!(
            memory_line(&m),
            "params 1.0 KiB | grads 2.0 KiB | optimizer 3.0 KiB | activations 5.0 MiB | \
             other 512 B | peak total 6.0 MiB"
        );
    }

    #[test]
    fn a_record_of_figures_that_are_no_number_reads_back() {
        let record = StepRecord {
            step: 3,
            loss: f32::NAN,
            mfu: f64::NAN,
            tokens_per_s: f64::INFINITY,
            lr: 1e-3,
            ..StepRecord::default()
        };
        let line = serde_json::to_string(&record).unwrap();
        assert!(
            line.contains(r#""loss":null"#) && line.contains(r#""mfu":null"#),
            "{line}"
        );
        let read: StepRecord = serde_json::from_str(&line).unwrap();
        assert_eq!((read.step, read.lr), (3, 1e-3));
        assert!(read.loss.is_nan() && read.mfu.is_nan() && read.tokens_per_s.is_nan());
    }

    #[test]
    fn timestamps_are_civil_utc() {
        assert_eq!(timestamp(0), "19700101-000000");
        assert_eq!(timestamp(951_782_400 + 3_723), "20000229-010203");
        assert_eq!(timestamp(1_795_320_454), "20261122-040734");
    }

    #[test]
    fn a_table_lines_up_cells_wider_than_their_heading() {
        let rows = vec![
            vec!["a long label that is wider".to_string(), "7".into()],
            vec!["b".into(), "12345678901".into()],
        ];
        let lines = table(&["strategy", "tokens/s"], &rows, &[0]);
        assert_eq!(
            lines,
            [
                "strategy                       tokens/s",
                "a long label that is wider            7",
                "b                           12345678901",
            ]
        );
        // a column named in `left` pads on its right (and trims at the end)
        let lines = table(&["strategy", "tokens/s"], &rows, &[0, 1]);
        assert_eq!(
            lines,
            [
                "strategy                    tokens/s",
                "a long label that is wider  7",
                "b                           12345678901",
            ]
        );
    }

    #[test]
    fn a_count_of_one_is_singular() {
        assert_eq!(count(1, "rank"), "1 rank");
        assert_eq!(count(0, "thread"), "0 threads");
        assert_eq!(count(4, "rank"), "4 ranks");
    }

    #[test]
    fn an_mfu_above_the_kept_peak_is_said() {
        assert_eq!(mfu_above_peak(0.999, false), None);
        let note = mfu_above_peak(1.2, false).expect("above 100%");
        assert!(
            note.contains("MFU 120.0% is above 100%") && note.contains("--measure"),
            "{note}"
        );
        // a stated peak is the user's: no kept one to measure again
        let note = mfu_above_peak(1.2, true).expect("above 100%");
        assert!(
            note.contains("the --peak-tflops given is below") && !note.contains("--measure"),
            "{note}"
        );
    }

    #[test]
    fn bytes_are_humanised() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }
}
